"""Block-sparse attention forward: each block of query rows attends only the key blocks listed for it.

Approximate by design (the listed blocks are a subset of the keys); over the blocks it is given it is ordinary
softmax attention in fp32 with bf16 operands, like any flash-attention forward. Reference: dense
`F.scaled_dot_product_attention` with a boolean mask that keeps exactly the listed (query block, key block) pairs
(`tests/test_fast_mode.py`, in the interpreter and on CUDA).

The sequence is cut into blocks of `BLOCK_ROWS` rows, for queries and keys alike (the last one ragged). Query blocks
[0, dense_query_blocks) attend every key block; for head h and each later query block i (counted from the first
sparse one), `kv_blocks[h, i, :kv_counts[h, i]]` are the key blocks it attends, in any order, each once; entries
past the count are never read. One program computes one (query block, head) tile with an online softmax over its
key blocks (base-2 exponentials, the scale folded into log2(e)), so the work is proportional to the kept blocks.
Given a dense attention function, the dense query blocks run there instead: a dense kernel such as FlashAttention-3
computes a block about 1.4x faster than this one on an H100 (measured at H3's 5 s shape: 5 % less time at density
0.15, where they are 18 % of the kept work; no measurable change at 0.25, 11 %).

On Hopper (sm90) the tiles are fetched with TMA tensor descriptors; elsewhere (and in the interpreter) with plain
pointer loads. The launch settings were chosen by measurement at H3's shape (56 heads x 128, 128-row blocks) on an
H100: 8 warps, 3 stages of key and value loads. The stages take shared memory that only the data-centre GPUs have
(224 KiB a program on sm90, 192 KiB with pointer loads), so a device with less runs fewer (`pipeline_stages`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from . import _launch

__all__ = ["BLOCK_ROWS", "block_sparse_attention"]

#: Rows per query and key block: the selection granularity and the kernel's tile height.
BLOCK_ROWS = 128

_LOG2E = 1.4426950408889634

#: Full attention of (1, rows, heads, D) queries over (1, S, heads, D) keys and values, (1, rows, heads, D) out.
DenseAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@triton.jit
def _block_sparse_attention_kernel(
    q_src, k_src, v_src, out_ptr,
    kv_blocks_ptr, kv_counts_ptr,
    n_rows, n_query_blocks, dense_query_blocks, first_query_block, max_kv, qk_scale,
    q_row_stride, k_row_stride, v_row_stride, out_row_stride,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Grid (query blocks from `first_query_block` on, heads). q/k/v rows hold every head's HEAD_DIM columns side by
    side (head h at column h * HEAD_DIM); with USE_TMA the three sources are (rows, heads * HEAD_DIM) tensor
    descriptors of BLOCK x HEAD_DIM tiles (zero-filled past the last row), else base pointers."""
    query_block = tl.program_id(0) + first_query_block
    head = tl.program_id(1)
    rows = query_block * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    column = head * HEAD_DIM
    if USE_TMA:
        q = q_src.load([query_block * BLOCK, column])
    else:
        q = tl.load(q_src + rows[:, None] * q_row_stride + column + dims[None, :], mask=rows[:, None] < n_rows,
                    other=0.0)

    row_max = tl.full([BLOCK], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    # Query blocks [0, dense_query_blocks) attend every key block in order; the others their listed ones (a dense
    # block reads entry 0 of the lists, in bounds, and ignores it: no branch inside the loop).
    dense = query_block < dense_query_blocks
    tile = tl.where(dense, 0, head * (n_query_blocks - dense_query_blocks) + query_block - dense_query_blocks)
    count = tl.where(dense, n_query_blocks, tl.load(kv_counts_ptr + tile))
    listed = kv_blocks_ptr + tile.to(tl.int64) * max_kv
    last_block = (n_rows - 1) // BLOCK
    for j in tl.range(0, count):
        key_block = tl.where(dense, j, tl.load(listed + tl.where(dense, 0, j)))
        keys = key_block * BLOCK + tl.arange(0, BLOCK)
        if USE_TMA:
            k = k_src.load([key_block * BLOCK, column])
            v = v_src.load([key_block * BLOCK, column])
        else:
            inside = keys[:, None] < n_rows
            k = tl.load(k_src + keys[:, None] * k_row_stride + column + dims[None, :], mask=inside, other=0.0)
            v = tl.load(v_src + keys[:, None] * v_row_stride + column + dims[None, :], mask=inside, other=0.0)
        scores = tl.dot(q, tl.trans(k))
        if key_block == last_block:  # the ragged last block: its rows past the sequence get no weight
            scores = tl.where(keys[None, :] < n_rows, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1) * qk_scale)
        # p's 16-bit copy and row sum straight after the exponentials, before the rescale: 1.5-3 % faster on an H100
        # than after it
        p = tl.math.exp2(scores * qk_scale - new_max[:, None])
        p_sum = tl.sum(p, 1)
        p = p.to(v.dtype)
        correction = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * correction + p_sum
        acc = acc * correction[:, None]
        acc = tl.dot(p, v, acc)
        row_max = new_max
    acc = acc / row_sum[:, None]
    tl.store(out_ptr + rows[:, None] * out_row_stride + column + dims[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rows[:, None] < n_rows)


def _rows_view(x: torch.Tensor, name: str) -> torch.Tensor:
    """(1, S, heads, D) with each row's heads side by side -> a (S, heads * D) view (copied only if they are not)."""
    if x.dim() != 4 or x.shape[0] != 1:
        raise ValueError(f"{name} must be (1, S, heads, head_dim), got {tuple(x.shape)}")
    if x.stride(3) != 1 or x.stride(2) != x.shape[3]:
        x = x.contiguous()
    return x[0].as_strided((x.shape[1], x.shape[2] * x.shape[3]), (x.stride(1), 1))


def pipeline_stages(max_shared_bytes: int) -> int:
    """Stages of key and value loads that fit a program's shared memory limit at head width 128 (Triton 3.9's
    compiles for sm80-sm121; tests/test_kernels_aot.py checks every family): 3 (224 KiB on sm90, 192 elsewhere) where
    227 KiB is allowed (sm90, sm100, sm103), 2 (128 KiB) where 163 KiB is (sm80), else 1 (96 KiB; sm86, sm89 and
    sm120 allow 99)."""
    return 3 if max_shared_bytes >= 224 * 1024 else 2 if max_shared_bytes >= 128 * 1024 else 1


@functools.cache
def _max_shared_bytes(device_index: int) -> int:
    """The shared memory one program may take on this device (the opt-in limit Triton launches against)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def _uses_tma(device: torch.device) -> bool:
    return not _launch.INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_blocks: torch.Tensor, kv_counts: torch.Tensor,
    dense_query_blocks: int = 0, dense: DenseAttention | None = None,
) -> torch.Tensor:
    """Attention of (1, S, heads, D) q, k, v (bf16 or fp16, scale 1/sqrt(D), non-causal) over the listed key blocks.

    dense_query_blocks: the leading query blocks that attend every key; kv_blocks: (heads, sparse query blocks,
    max_kv) int32 key-block indices of the others, sparse query blocks = ceil(S / BLOCK_ROWS) - dense_query_blocks;
    kv_counts: (heads, sparse query blocks) int32, each in [1, max_kv]; dense: when given, full attention of
    (1, rows, heads, D) queries over (1, S, heads, D) keys and values (scale 1/sqrt(D)), which then computes the dense
    query blocks' rows instead of this kernel. Returns (1, S, heads, D) contiguous, q's dtype.
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
    stages = 3  # in the interpreter and the AOT capture (CPU tensors): the H100's
    if q.device.type == "cuda" and not _launch.INTERPRET:
        index = torch.cuda.current_device() if q.device.index is None else q.device.index
        stages = pipeline_stages(_max_shared_bytes(index))
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        sources = tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [BLOCK_ROWS, head_dim])
                        for t in (q2, k2, v2))
    first = dense_query_blocks if dense is not None else 0
    if first < query_blocks:
        _block_sparse_attention_kernel[(query_blocks - first, heads)](
            *sources, out2, kv_blocks, kv_counts,
            rows, query_blocks, dense_query_blocks, first, kv_blocks.shape[2], _LOG2E / math.sqrt(head_dim),
            q2.stride(0), k2.stride(0), v2.stride(0), out2.stride(0),
            BLOCK=BLOCK_ROWS, HEAD_DIM=head_dim, USE_TMA=use_tma,
            num_warps=8, num_stages=stages,
        )
    if dense is not None and first:
        dense_rows = min(rows, first * BLOCK_ROWS)
        out[:, :dense_rows] = dense(q[:, :dense_rows], k, v)
    return out
