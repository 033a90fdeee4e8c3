"""Block-sparse attention for the `sparse-attention` fast mode (approximate): which key blocks each query block
attends, and the attention function the main blocks call.

The packed sequence is cut into `BLOCK_ROWS`-row blocks. Everything before the generated video (text, conditioning
pictures or video, audio: the prefix) stays dense in both directions: a query block holding any prefix row attends
every key, and every video query block attends every prefix key block (the prefix acts as the attention sinks). Among
the generated video's key blocks, each video query block keeps, per head and per call:

* its own block and `local_blocks` neighbours on each side (spatial and temporal neighbours in the raster order);
* then the blocks with the highest pooled scores, softmax(mean(q_i) . mean(k_j) / sqrt(D)) over the video key blocks,
  in descending order (equal scores: the lower block first), until their cumulative mass reaches `mass` or the
  block budget is spent.

`density` is the share of the whole attention map computed, (query block, key block) pairs over all of them, the one
the request's report gives back as the density reached: the dense prefix rows and every video query block's prefix
keys count against it, and the video query blocks share what is left evenly (the budget, rounded down). Only the local
blocks can take a query block past it, where the budget is smaller than they are.

The selection is training-free and costs a few pooled matrix products per call (no full score matrix). On CUDA the
ranking runs in `vflash_kernels.block_selection`; the kept blocks run in FlashAttention-4's block-sparse forward on
Hopper where flash-attn-4 is installed (`sparse_backend`), in `vflash_kernels.block_sparse_attention` elsewhere; the
query blocks holding prefix rows run in the dense backend (FlashAttention-3 on Hopper computes a block faster than
Vflash's kernel). A session starts the backend's first use (an import, compiles) in a background thread while it loads
its weights (`BlockSparseAttention.prepare`). On the CPU they run through their references, `rank_key_blocks_reference`
and the masked dense attention (`masked_attention`), which are also what the kernels are tested against.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .model import AttentionFn

logger = logging.getLogger(__name__)

__all__ = [
    "BLOCK_ROWS", "FLASH_ATTN4_BACKEND", "MASKED_BACKEND", "TRITON_BACKEND", "BlockSelection", "BlockSparseAttention",
    "attend_selected", "cuda_sparse_backend", "flash_attn4_block_sparse_attention", "masked_attention",
    "prepare_sparse_backend", "rank_key_blocks_reference", "select_key_blocks", "sparse_backend", "video_key_budget",
]

#: Rows per query and key block (the kernel's tile height; `vflash_kernels.block_sparse_attention.BLOCK_ROWS`).
BLOCK_ROWS = 128

#: What runs the kept blocks of a sparse call (the request's report names it).
FLASH_ATTN4_BACKEND = "flash-attn-4-block-sparse"
TRITON_BACKEND = "vflash-block-sparse-triton"
MASKED_BACKEND = "masked-sdpa"


@dataclass(frozen=True)
class BlockSelection:
    """Which key blocks each query block attends, in the kernel's form.

    dense_query_blocks: query blocks [0, dense_query_blocks) attend every key block;
    kv_blocks: (heads, video query blocks, max_kv) int32 key-block indices of the other query blocks (prefix key blocks
    first, then the kept video blocks ascending); kv_counts: (heads, video query blocks) int32, how many are listed;
    blocks: key (= query) blocks in the sequence.
    """

    dense_query_blocks: int
    kv_blocks: torch.Tensor
    kv_counts: torch.Tensor
    blocks: int

    def kept_pairs_on_device(self) -> torch.Tensor:
        """(query block, key block) pairs computed, summed over heads, as a device scalar (no sync)."""
        heads = self.kv_counts.shape[0]
        return self.kv_counts.sum() + heads * self.dense_query_blocks * self.blocks

    @property
    def kept_pairs(self) -> int:
        """`kept_pairs_on_device` on the host (a device sync)."""
        return int(self.kept_pairs_on_device())

    @property
    def total_pairs(self) -> int:
        return self.kv_counts.shape[0] * self.blocks * self.blocks

    def block_mask(self) -> torch.Tensor:
        """(heads, blocks, blocks) bool: True where the query block attends the key block."""
        heads, _, max_kv = self.kv_blocks.shape
        mask = torch.zeros(heads, self.blocks, self.blocks, dtype=torch.bool, device=self.kv_blocks.device)
        mask[:, : self.dense_query_blocks] = True
        listed = (torch.arange(max_kv, device=self.kv_blocks.device) < self.kv_counts[..., None]).to(torch.int32)
        hits = torch.zeros(heads, self.blocks - self.dense_query_blocks, self.blocks, dtype=torch.int32,
                           device=self.kv_blocks.device)
        # entries past a count may hold an out-of-range marker: clamped, they add nothing (weight 0)
        index = self.kv_blocks.long().clamp(max=self.blocks - 1)
        mask[:, self.dense_query_blocks :] = hits.scatter_add_(2, index, listed) > 0
        return mask


def _pooled(x: torch.Tensor, first_row: int) -> torch.Tensor:
    """(1, S, heads, D) -> (heads, blocks, D) fp32 mean of each block of rows from `first_row` on (the last block
    ragged), accumulated in fp32 without an fp32 copy of x."""
    rows = x[0, first_row:]
    full = rows.shape[0] // BLOCK_ROWS
    sums = [rows[: full * BLOCK_ROWS].unflatten(0, (full, BLOCK_ROWS)).sum(1, dtype=torch.float32)]
    counts = [torch.full((full,), float(BLOCK_ROWS), device=x.device)]
    if rows.shape[0] > full * BLOCK_ROWS:
        sums.append(rows[full * BLOCK_ROWS :].sum(0, keepdim=True, dtype=torch.float32))
        counts.append(torch.full((1,), float(rows.shape[0] - full * BLOCK_ROWS), device=x.device))
    means = torch.cat(sums) / torch.cat(counts)[:, None, None]
    return means.transpose(0, 1)


def video_key_budget(density: float, blocks: int, prefix: int) -> int:
    """How many video key blocks each video query block may keep so that the whole map of `blocks` x `blocks` pairs,
    whose `prefix` leading query blocks are dense and whose video query blocks all attend the prefix keys, computes
    at most `density` of its pairs (at least 1, at most all of them)."""
    video = blocks - prefix
    share = (density * blocks * blocks - prefix * blocks) / video - prefix
    return min(video, max(1, math.floor(share + 1e-9)))  # the epsilon: a density that is exactly reachable reaches it


def select_key_blocks(
    q: torch.Tensor, k: torch.Tensor, sparse_from_row: int, density: float, mass: float, local_blocks: int
) -> BlockSelection:
    """The key blocks each query block of (1, S, heads, D) q attends, for a sequence whose rows [0, sparse_from_row)
    are the dense prefix (see the module docstring). On CUDA the ranking runs in `vflash_kernels.block_selection`
    (the same rule as `rank_key_blocks_reference`, which runs elsewhere; the two sum the mass in other orders)."""
    rows, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    blocks = -(-rows // BLOCK_ROWS)
    prefix = min(blocks, -(-sparse_from_row // BLOCK_ROWS))  # blocks holding any prefix row
    if blocks == prefix:
        empty = torch.zeros(heads, 0, 1, dtype=torch.int32, device=q.device)
        return BlockSelection(blocks, empty, empty[..., 0], blocks)
    scores = torch.einsum("hid,hjd->hij", _pooled(q, prefix * BLOCK_ROWS), _pooled(k, prefix * BLOCK_ROWS))
    probabilities = (scores / math.sqrt(head_dim)).softmax(-1)
    budget = video_key_budget(density, blocks, prefix)
    if q.device.type == "cuda":
        from vflash_kernels.block_selection import rank_key_blocks

        kv_blocks, kv_counts = rank_key_blocks(probabilities, prefix, budget, mass, local_blocks)
    else:
        kv_blocks, kv_counts = rank_key_blocks_reference(probabilities, prefix, budget, mass, local_blocks)
    return BlockSelection(prefix, kv_blocks, kv_counts, blocks)


def rank_key_blocks_reference(
    probabilities: torch.Tensor, prefix: int, budget: int, mass: float, local_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept key blocks of (heads, video, video) fp32 pooled `probabilities` (softmax over the video key blocks):
    (heads, video, prefix + listed) int32 lists, the prefix blocks first, then the kept video blocks ascending, then
    out-of-range markers (prefix + video), and (heads, video) int32 counts; listed = min(video, max(budget,
    2 * local_blocks + 1)). Forced first (the local blocks), then by probability descending, ties to the lower index:
    a block is kept while fewer than `budget` blocks rank above it and their mass is below `mass`."""
    heads, video, _ = probabilities.shape
    device = probabilities.device
    position = torch.arange(video, device=device)
    forced = (position[:, None] - position[None, :]).abs() <= local_blocks  # (video, video)
    # The forced blocks sort first (above any probability), then by pooled score; only the first `listed` can be kept.
    listed = min(video, max(budget, 2 * local_blocks + 1))
    ranked_key, ranked = probabilities.masked_fill(forced, 2.0).sort(dim=-1, descending=True, stable=True)
    ranked_key, ranked = ranked_key[..., :listed], ranked[..., :listed]
    ranked_p = probabilities.gather(-1, ranked)
    mass_before = ranked_p.cumsum(-1) - ranked_p
    keep = (ranked_key > 1.0) | ((mass_before < mass) & (position[:listed] < budget))
    counts = keep.sum(-1)
    # kept blocks ascending (for locality), then the unkept as an out-of-range marker past them; prefix blocks first
    kept = torch.where(keep, ranked, video).sort(-1).values.to(torch.int32) + prefix
    head_blocks = torch.arange(prefix, dtype=torch.int32, device=device).expand(heads, video, prefix)
    kv_blocks = torch.cat([head_blocks, kept], dim=-1).contiguous()
    return kv_blocks, (counts + prefix).to(torch.int32)


@functools.cache
def _flash_attn4() -> tuple[Any, Any] | None:
    """flash-attn-4's `flash_attn_func` and its block-sparsity tensors' type, or None where it is not installed."""
    try:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        from flash_attn.cute.interface import flash_attn_func
    except (ImportError, OSError):  # OSError: its CUDA DSL libraries present but not loadable here
        return None
    _quiet_flash_attn4_compile_warning()
    return flash_attn_func, BlockSparseTensorsTorch


def _quiet_flash_attn4_compile_warning() -> None:
    """Hide the warning each compile of flash-attn-4's Hopper forward prints: its `aux_data` argument (empty here) is
    not a type the CUDA DSL passes at run time, and the warning, a screenful of mangled kernel name, gives a user
    nothing to act on. Other warnings of the CUDA DSL still show."""
    warnings.filterwarnings(
        "ignore", r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument", UserWarning
    )


def sparse_backend(q: torch.Tensor) -> str:
    """What runs the kept blocks for (1, S, heads, D) q: the masked dense reference off CUDA, else
    `cuda_sparse_backend`."""
    if q.device.type != "cuda":
        return MASKED_BACKEND
    return cuda_sparse_backend(torch.cuda.get_device_capability(q.device), q.shape[-1])


def cuda_sparse_backend(capability: tuple[int, int], head_dim: int) -> str:
    """What runs the kept blocks on a CUDA device of `capability`: FlashAttention-4's block-sparse forward on Hopper
    (sm90) where flash-attn-4 is installed and `head_dim` is a multiple of 16 up to 128, where its tiles are the
    128-row blocks; Vflash's Triton kernel elsewhere. FlashAttention-4 overlaps one warp group's softmax with another's
    matrix products, which the Triton kernel cannot: on one H100 at H3's 1344x768 5 s map and density 0.25 it ran
    16.4 ms where the Triton kernel ran 20.0 (FlashAttention-3 dense: 60.1)."""
    if capability[0] != 9 or head_dim > 128 or head_dim % 16:
        return TRITON_BACKEND
    if _flash_attn4() is None:
        _say_flash_attn4_is_missing()
        return TRITON_BACKEND
    return FLASH_ATTN4_BACKEND


@functools.cache
def _say_flash_attn4_is_missing() -> None:
    logger.info("sparse-attention on Hopper: flash-attn-4 is not installed, so Vflash's Triton kernel runs the kept "
                "blocks (FlashAttention-4's block-sparse forward is about 1.2x faster there: "
                "pip install 'vflash[sm90]')")


def flash_attn4_block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, dense: AttentionFn
) -> torch.Tensor:
    """Attention of (1, S, heads, D) q, k, v over `selection` in FlashAttention-4's block-sparse forward (every listed
    block whole, as its "full" blocks; the ragged last key block is bounded by the sequence length); the dense query
    blocks' rows through `dense`. Returns (1, S, heads, D), q's dtype."""
    functions = _flash_attn4()
    if functions is None:
        raise RuntimeError("flash-attn-4 is not installed")
    flash_attn_func, block_sparse_tensors = functions
    rows = q.shape[1]
    first = min(rows, selection.dense_query_blocks * BLOCK_ROWS)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if first:
        out[:, :first] = dense(q[:, :first], k, v)
    if first < rows:
        heads, sparse_blocks = selection.kv_counts.shape
        none = torch.zeros(1, heads, sparse_blocks, dtype=torch.int32, device=q.device)  # no partially masked blocks
        tensors = block_sparse_tensors(
            mask_block_cnt=none, mask_block_idx=none[..., None], full_block_cnt=selection.kv_counts[None],
            full_block_idx=selection.kv_blocks[None], block_size=(BLOCK_ROWS, BLOCK_ROWS),
        )
        out[:, first:] = flash_attn_func(q[:, first:], k, v, block_sparse_tensors=tensors)[0]
    return out


def attend_selected(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, dense: AttentionFn, backend: str
) -> torch.Tensor:
    """Attention of (1, S, heads, D) q, k, v over `selection` in `backend` (see `sparse_backend`); on CUDA the dense
    query blocks' rows through `dense`."""
    if backend == MASKED_BACKEND:
        return masked_attention(q, k, v, selection)
    if backend == FLASH_ATTN4_BACKEND:
        return flash_attn4_block_sparse_attention(q, k, v, selection, dense)
    from vflash_kernels.block_sparse_attention import block_sparse_attention

    return block_sparse_attention(
        q, k, v, selection.kv_blocks, selection.kv_counts, selection.dense_query_blocks, dense
    )


#: One preparation at a time: the devices of a multi-device session share the compiled kernels.
_PREPARE_LOCK = threading.Lock()


def prepare_sparse_backend(device: torch.device, head_dim: int, dense: AttentionFn) -> str:
    """Pay the first-use cost of `device`'s sparse backend now, with one small sparse call in bf16: flash-attn-4's
    import and its kernel's compile took 9.8 s and 5.5 s on a fresh H100 machine; Triton's kernels compile too. Their
    compiled kernels are keyed on the dtype, the head size and the kind of call, not on the sequence length, so a
    request's calls reuse them. Deterministic inputs: no random generator is drawn from. Returns the backend."""
    rows, heads = 4 * BLOCK_ROWS, 2
    with _PREPARE_LOCK, torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        x = torch.linspace(-1.0, 1.0, rows * heads * head_dim, device=device).reshape(1, rows, heads, head_dim)
        x = x.to(torch.bfloat16)
        selection = select_key_blocks(x, x, BLOCK_ROWS, 0.5, 1.0, 1)
        backend = sparse_backend(x)
        attend_selected(x, x, x, selection, dense, backend)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return backend


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection) -> torch.Tensor:
    """The reference: dense attention of (1, S, heads, D) q, k, v with every pair outside the selection masked out."""
    rows = q.shape[1]
    mask = selection.block_mask().repeat_interleave(BLOCK_ROWS, 1).repeat_interleave(BLOCK_ROWS, 2)
    mask = mask[:, :rows, :rows]
    out = F.scaled_dot_product_attention(
        q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), attn_mask=mask[None]
    )
    return out.permute(0, 2, 1, 3)


class BlockSparseAttention:
    """The main blocks' attention under the sparse-attention fast mode: an `AttentionFn` that runs sparse only while
    the denoiser has armed it for a sparse layer (`arm`), and `dense` otherwise (the text refiner, dense edge layers,
    dense evaluations). Counts what ran for the request's report."""

    def __init__(self, dense: AttentionFn, density: float, mass: float, local_blocks: int):
        self.dense = dense
        self.density, self.mass, self.local_blocks = density, mass, local_blocks
        self.sparse_from_row: int | None = None  # None: disarmed
        self._prepared: Future[None] | None = None  # `prepare` running or done, until the first sparse call
        self.reset()

    def prepare(self, device: torch.device, head_dim: int) -> None:
        """Start `prepare_sparse_backend` on `device` in a background thread, so that its cost is paid while the
        session loads its weights rather than in the first request; the first sparse call waits for it."""
        if self._prepared is not None:
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="vflash-sparse-prepare")
        self._prepared = pool.submit(self._prepare, device, head_dim)
        pool.shutdown(wait=False)

    def _prepare(self, device: torch.device, head_dim: int) -> None:
        start = time.perf_counter()
        try:
            backend = prepare_sparse_backend(device, head_dim, self.dense)
        except Exception as error:  # noqa: BLE001 - an early start only: the first sparse call compiles, raises there
            logger.warning("sparse-attention on %s: preparing the sparse backend failed (%s: %s); the first sparse "
                           "call pays its first use", device, type(error).__name__, error)
            return
        logger.info("sparse-attention on %s: the kept blocks run in %s (ready in %.1f s, prepared while the weights "
                    "load)", device, backend, time.perf_counter() - start)

    def reset(self) -> None:
        self.backend: str | None = None  # what ran the sparse calls' kept blocks (`sparse_backend`)
        self.dense_calls = 0
        self.sparse_calls = 0
        self._kept: torch.Tensor | int = 0  # summed on the device, read once per request
        self.total_pairs = 0

    def arm(self, sparse_from_row: int | None) -> None:
        """Sparse calls from now on, over a sequence whose rows before `sparse_from_row` are the dense prefix; None:
        dense calls."""
        self.sparse_from_row = sparse_from_row

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.sparse_from_row is None:
            self.dense_calls += 1
            return self.dense(q, k, v)
        if self._prepared is not None:
            self._prepared.result()
            self._prepared = None
        selection = select_key_blocks(q, k, self.sparse_from_row, self.density, self.mass, self.local_blocks)
        self.sparse_calls += 1
        self._kept = self._kept + selection.kept_pairs_on_device()
        self.total_pairs += selection.total_pairs
        self.backend = sparse_backend(q)
        return attend_selected(q, k, v, selection, self.dense, self.backend)

    @property
    def kept_pairs(self) -> int:
        """(query block, key block) pairs computed in this request's sparse calls, summed over heads (a sync)."""
        return int(self._kept)

    def density_reached(self) -> float | None:
        """Kept (query block, key block) pairs over all pairs of this request's sparse calls (None: none ran)."""
        return self.kept_pairs / self.total_pairs if self.total_pairs else None
