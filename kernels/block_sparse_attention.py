"""Block-sparse attention forward: each block of query rows attends only the key blocks listed for it.

Approximate by design (the listed blocks are a subset of the keys); over the blocks it is given it is ordinary
softmax attention in fp32 with bf16 operands, like any flash-attention forward. Reference: dense
`F.scaled_dot_product_attention` with a boolean mask that keeps exactly the listed (query block, key block) pairs
(`tests/test_block_sparse_attention.py`).

The sequence is cut into blocks of `BLOCK_ROWS` rows, for queries and keys alike (the last one ragged). Query blocks
[0, dense_query_blocks) attend every key block; for head h and each later query block i (counted from the first
sparse one), `kv_blocks[h, i, :kv_counts[h, i]]` are the key blocks it attends, each once, ascending (any order
would do for the softmax; ascending puts the ragged last block, if listed, last, where the kernel masks it); entries
past the count are never read. One program computes one (query block, head) tile with an online softmax over its
key blocks (base-2 exponentials, the scale folded into log2(e)), so the work is proportional to the kept blocks.

On Hopper (sm90) the tiles are fetched with TMA tensor descriptors; elsewhere (and in the interpreter) with plain
pointer loads. The launch settings were chosen by measurement at H3's shape (56 heads x 128, 128-row blocks).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _launch

__all__ = ["BLOCK_ROWS", "block_sparse_attention"]

#: Rows per query and key block: the selection granularity and the kernel's tile height.
BLOCK_ROWS = 128

_LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(src, first_row, column, n_rows, row_stride, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Rows [first_row, first_row + BLOCK) of one head's HEAD_DIM columns; rows past the sequence read as zero."""
    if USE_TMA:
        tile = src.load([first_row, column])
    else:
        rows = first_row + tl.arange(0, BLOCK)
        dims = tl.arange(0, HEAD_DIM)
        tile = tl.load(src + rows[:, None] * row_stride + column + dims[None, :], mask=rows[:, None] < n_rows,
                       other=0.0)
    return tile


@triton.jit
def _attend_key_block(q, k_src, v_src, key_block, column, n_rows, qk_scale, k_row_stride, v_row_stride,
                      row_max, row_sum, acc, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr,
                      RAGGED: tl.constexpr):
    """One step of the online softmax over key block `key_block`. RAGGED: the block may end past the sequence, so
    its rows there get no weight (only the last listed block can be ragged: the loops peel it off)."""
    k = _load_tile(k_src, key_block * BLOCK, column, n_rows, k_row_stride, BLOCK, HEAD_DIM, USE_TMA)
    v = _load_tile(v_src, key_block * BLOCK, column, n_rows, v_row_stride, BLOCK, HEAD_DIM, USE_TMA)
    scores = tl.dot(q, tl.trans(k))
    if RAGGED:
        keys = key_block * BLOCK + tl.arange(0, BLOCK)
        scores = tl.where(keys[None, :] < n_rows, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1) * qk_scale)
    p = tl.math.exp2(scores * qk_scale - new_max[:, None])
    correction = tl.math.exp2(row_max - new_max)
    row_sum = row_sum * correction + tl.sum(p, 1)
    acc = acc * correction[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return new_max, row_sum, acc


@triton.jit
def _block_sparse_attention_kernel(
    q_src, k_src, v_src, out_ptr,
    kv_blocks_ptr, kv_counts_ptr,
    n_rows, n_query_blocks, dense_query_blocks, max_kv, qk_scale,
    q_row_stride, k_row_stride, v_row_stride, out_row_stride,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Grid (heads * query blocks,): the dense tiles (every head's leading query blocks, the longest) first, so
    they do not trail the launch; then each head's sparse query blocks in order (neighbours share key blocks in L2).
    q/k/v rows hold every head's HEAD_DIM columns side by side (head h at column h * HEAD_DIM); with USE_TMA the three
    sources are (rows, heads * HEAD_DIM) tensor descriptors of BLOCK x HEAD_DIM tiles (zero-filled past the last
    row), else base pointers."""
    tile = tl.program_id(0)
    sparse_blocks = n_query_blocks - dense_query_blocks
    dense_tiles = tl.num_programs(0) // n_query_blocks * dense_query_blocks
    dense = tile < dense_tiles
    head = tl.where(dense, tile // tl.maximum(dense_query_blocks, 1), (tile - dense_tiles) // tl.maximum(sparse_blocks, 1))
    query_block = tl.where(dense, tile - head * dense_query_blocks,
                           dense_query_blocks + (tile - dense_tiles) - head * sparse_blocks)
    column = head * HEAD_DIM
    q = _load_tile(q_src, query_block * BLOCK, column, n_rows, q_row_stride, BLOCK, HEAD_DIM, USE_TMA)

    row_max = tl.full([BLOCK], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    # The last key block of each loop is peeled off and masked: the hot loop has no branch. A dense query block
    # attends every key block in order (the sequence's ragged block last); a sparse one its listed blocks, which
    # ascend, so the ragged block, if kept, is listed last.
    if dense:
        last = n_query_blocks - 1
        for key_block in tl.range(0, last):
            row_max, row_sum, acc = _attend_key_block(q, k_src, v_src, key_block, column, n_rows, qk_scale,
                                                      k_row_stride, v_row_stride, row_max, row_sum, acc,
                                                      BLOCK, HEAD_DIM, USE_TMA, False)
    else:
        listed = kv_blocks_ptr + (head * sparse_blocks + query_block - dense_query_blocks).to(tl.int64) * max_kv
        count = tl.load(kv_counts_ptr + head * sparse_blocks + query_block - dense_query_blocks)
        for j in tl.range(0, count - 1):
            row_max, row_sum, acc = _attend_key_block(q, k_src, v_src, tl.load(listed + j), column, n_rows, qk_scale,
                                                      k_row_stride, v_row_stride, row_max, row_sum, acc,
                                                      BLOCK, HEAD_DIM, USE_TMA, False)
        last = tl.load(listed + count - 1)
    row_max, row_sum, acc = _attend_key_block(q, k_src, v_src, last, column, n_rows, qk_scale, k_row_stride,
                                              v_row_stride, row_max, row_sum, acc, BLOCK, HEAD_DIM, USE_TMA, True)
    acc = acc / row_sum[:, None]
    rows = query_block * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + rows[:, None] * out_row_stride + column + dims[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rows[:, None] < n_rows)


def _rows_view(x: torch.Tensor, name: str) -> torch.Tensor:
    """(1, S, heads, D) with each row's heads side by side -> a (S, heads * D) view (copied only if they are not)."""
    if x.dim() != 4 or x.shape[0] != 1:
        raise ValueError(f"{name} must be (1, S, heads, head_dim), got {tuple(x.shape)}")
    if x.stride(3) != 1 or x.stride(2) != x.shape[3]:
        x = x.contiguous()
    return x[0].as_strided((x.shape[1], x.shape[2] * x.shape[3]), (x.stride(1), 1))


def _uses_tma(device: torch.device) -> bool:
    return not _launch.INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_blocks: torch.Tensor, kv_counts: torch.Tensor,
    dense_query_blocks: int = 0,
) -> torch.Tensor:
    """Attention of (1, S, heads, D) q, k, v (bf16 or fp16, scale 1/sqrt(D), non-causal) over the listed key blocks.

    dense_query_blocks: the leading query blocks that attend every key; kv_blocks: (heads, sparse query blocks,
    max_kv) int32 key-block indices of the others, ascending, sparse query blocks = ceil(S / BLOCK_ROWS) - dense_query_blocks;
    kv_counts: (heads, sparse query blocks) int32, each in [1, max_kv]. Returns (1, S, heads, D) contiguous, q's dtype.
    """
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k and v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    _, rows, heads, head_dim = q.shape
    query_blocks = triton.cdiv(rows, BLOCK_ROWS)
    if not 0 <= dense_query_blocks <= query_blocks:
        raise ValueError(f"dense_query_blocks must be in [0, {query_blocks}], got {dense_query_blocks}")
    sparse = query_blocks - dense_query_blocks
    if kv_blocks.dim() != 3 or tuple(kv_blocks.shape[:2]) != (heads, sparse) or kv_blocks.dtype != torch.int32:
        raise ValueError(f"kv_blocks must be int32 ({heads}, {sparse}, max_kv), got "
                         f"{kv_blocks.dtype} {tuple(kv_blocks.shape)}")
    if tuple(kv_counts.shape) != (heads, sparse) or kv_counts.dtype != torch.int32:
        raise ValueError(f"kv_counts must be int32 ({heads}, {sparse}), got {kv_counts.dtype} "
                         f"{tuple(kv_counts.shape)}")
    if sparse == 0:  # every query block dense: the lists are never used, but their entry 0 is read
        kv_blocks = torch.zeros(heads, 1, 1, dtype=torch.int32, device=q.device)
        kv_counts = torch.ones(heads, 1, dtype=torch.int32, device=q.device)
    _launch.check_device(q, k, v, kv_blocks, kv_counts)
    kv_blocks, kv_counts = kv_blocks.contiguous(), kv_counts.contiguous()
    q2, k2, v2 = _rows_view(q, "q"), _rows_view(k, "k"), _rows_view(v, "v")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    out2 = out[0].view(rows, heads * head_dim)
    sources: tuple[object, object, object] = (q2, k2, v2)
    use_tma = _uses_tma(q.device)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        sources = tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [BLOCK_ROWS, head_dim])
                        for t in (q2, k2, v2))
    _block_sparse_attention_kernel[(heads * query_blocks,)](
        *sources, out2, kv_blocks, kv_counts,
        rows, query_blocks, dense_query_blocks, kv_blocks.shape[2], _LOG2E / math.sqrt(head_dim),
        q2.stride(0), k2.stride(0), v2.stride(0), out2.stride(0),
        BLOCK=BLOCK_ROWS, HEAD_DIM=head_dim, USE_TMA=use_tma,
        num_warps=8, num_stages=3,
    )
    return out
