"""CUDA paged MLA attention and latent-cache write (hipkernels/attention/mla_*.hip, kv_cache_write.hip).
The facade has validated shapes and devices; fp16/bf16 at DeepSeek-V3's widths (512 + 64) run the
attention kernel, anything else the reference.

Under KernelConfig.batch_invariant the kernel sums a query's keys in fixed ranges of SPLIT_BLOCK
keys, each from a fresh state, merged in range order (hipkernels/attention/mla_ranges.h;
reference.mla.paged_attention_mla_ranges); which block computes a range does not change the bits:
decode and verify rows give each range a block (partials in the workspace, merged by the combine
kernel), longer rows and rows of one range are walked by one block (ranges in turn, merged state in
a slab of the accumulator pool); every row walks when that fills the device about as well
(walk_pays: batch 64 at context 4096), or when force_walk asks. The default mode keeps the per-row
split rule (at most MAX_SPLITS splits per row, larger as the context grows: fewer partials at long
contexts; a token's bits depend on its row's context and query length there), except where
walking fills the device: then every row is walked as one range (default_walk_unit: no range ends
to fold; batch 64 on an H100). benchmarks/results/mla_instr_diet_h100.json and
mla_one_range_default_h100.json compare them."""
from __future__ import annotations

import torch

from pyengine.engine.attention_metadata import AttentionMetadata
from pyengine.ops import reference
from pyengine.ops.cuda.attention import SPLIT_BLOCK, new_outputs, plan, split_workspace
from pyengine.ops.cuda.launch import DTYPE_CODE, aligned_rows, kernels, num_sms, params, row_stride, slots, stream
from pyengine.ops.kernel_config import get_kernel_config
from pyengine.ops.reference.mla import KV_LORA_RANK, ROPE_DIM, paged_attention_mla_ranges

PAIR_TILE = 64  # query-head pairs per block of the fast tile (hipkernels/attention/mla_tile.h)
# batch_invariant only. True: every row of a step walks its ranges (the same bits; tests and
# benchmarks force it); False: only the rows the combine does not take; None: walk_pays decides.
force_walk: bool | None = None

_pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def accumulator_pool(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 slabs for the walking blocks (one 64 x 512 slab per SM: the fast tile runs one block per
    SM; the small tile's 16-row slabs fit 4 per SM in the same bytes) and their locks, zero between
    launches. One pool per device, allocated on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _pools.get(index)
    if pool is None:
        n = num_sms(device)
        pool = (torch.empty(n * PAIR_TILE * KV_LORA_RANK, dtype=torch.float32, device=device),
                torch.zeros(4 * n, dtype=torch.int32, device=device))
        _pools[index] = pool
    return pool


def walk_pays(meta: AttentionMetadata, num_heads: int, max_ranges: int, device: torch.device) -> bool:
    """Whether every row should walk its ranges (batch_invariant; the same bits as a block per
    range). Counted in waves of the fast tile's one block per SM, the walk may take up to 1.25x the
    waves of a block per range and still win, as it skips the partials' round trip through HBM and
    the combine (benchmarks/results/mla_ranges_h100.json, H100: batch 64 at context 4096 one wave
    against 8, walk 0.246 vs split 0.294 ms; verify q = 5 40 range-waves against 39, 1.09 vs 1.33;
    batch 8: 16 walking blocks leave most SMs idle, 5x slower). The small tile (more blocks per SM,
    16 pairs) keeps the per-range blocks."""
    if max_ranges <= 1 or get_kernel_config().mla_small_tile or torch.version.hip is not None:
        return False
    walkers = meta.num_rows * -(-int(meta.max_query_len) * num_heads // PAIR_TILE)
    sms = num_sms(device)
    return 4 * -(-walkers // sms) * max_ranges <= 5 * -(-walkers * max_ranges // sms)


def default_walk_unit(meta: AttentionMetadata, num_heads: int, max_ranges: int, device: torch.device) -> int | None:
    """The default mode (no batch invariance, any split valid): where walking fills the device as
    walk_pays counts it for the fixed ranges, every row is walked as one range (the unit returned:
    the step's longest context, rounded up to whole 64-key tiles), which has no range ends to fold;
    None keeps the per-row split rule. H100, batch 64 (benchmarks/results/mla_one_range_default_h100.json):
    ctx 4096 / 16k / 32k and verify q = 2 / 5 at about 0.15 / 0.63 / 1.25 and 0.30 / 0.76 ms against
    the rule's 0.28 / 0.86 / 1.47 and 0.51 / 1.20."""
    if not walk_pays(meta, num_heads, max_ranges, device):
        return None
    return -(-int(meta.max_context_len) // 64) * 64  # a whole number of 64-key tiles (the launch's rule)


def reshape_and_cache_mla(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    if kv_cache.dtype not in DTYPE_CODE:
        return reference.reshape_and_cache_mla(c_kv, k_pe, kv_cache, slot_mapping)
    num_tokens = c_kv.shape[0]
    slot_ids = slots(slot_mapping)
    if num_tokens == 0:
        return
    c_kv = c_kv.to(kv_cache.dtype)
    k_pe = k_pe.to(kv_cache.dtype)
    if c_kv.stride(-1) != 1:
        c_kv = c_kv.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    p = params(kernels.ReshapeAndCacheMlaParams, c_kv=c_kv.data_ptr(), k_pe=k_pe.data_ptr(),
               kv_cache=kv_cache.data_ptr(), slot_mapping=slot_ids.data_ptr(), num_tokens=num_tokens,
               kv_lora_rank=c_kv.shape[1], rope_dim=k_pe.shape[1], c_kv_stride_token=row_stride(c_kv),
               k_pe_stride_token=row_stride(k_pe), elem_size=kv_cache.element_size())
    with torch.cuda.device(c_kv.device):
        kernels.reshape_and_cache_mla(p, stream(c_kv.device))


def paged_attention_mla(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        return_lse: bool = False, kv_lora_rank: int = KV_LORA_RANK
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if (q.dtype not in (torch.float16, torch.bfloat16) or kv_cache.dtype != q.dtype
            or (kv_lora_rank, kv_cache.shape[2]) != (KV_LORA_RANK, KV_LORA_RANK + ROPE_DIM)):
        if get_kernel_config().batch_invariant:  # the same ranges and merge as the kernel, per row
            return paged_attention_mla_ranges(q, kv_cache, meta, scale, return_lse=return_lse,
                                              kv_lora_rank=kv_lora_rank, range_size=SPLIT_BLOCK)
        return reference.paged_attention_mla(q, kv_cache, meta, scale, return_lse=return_lse, kv_lora_rank=kv_lora_rank)
    num_heads, head_dim = q.shape[1:]
    out, lse, work = new_outputs(q, KV_LORA_RANK, return_lse, meta)
    if not work:
        return (out, lse) if return_lse else out
    step = plan(meta, q.device)
    fixed, unit = bool(get_kernel_config().batch_invariant), SPLIT_BLOCK
    if fixed:  # the bits are the same either way: only the speed follows the batch
        walk = walk_pays(meta, num_heads, step["max_splits_fixed"], q.device) if force_walk is None else force_walk
    else:  # any split is valid here: one range a row, walked, where that is the faster
        walk_unit = default_walk_unit(meta, num_heads, step["max_splits_fixed"], q.device)
        walk = fixed = walk_unit is not None
        unit = walk_unit or unit
    max_splits = 1 if walk else step["max_splits_fixed" if fixed else "max_splits"]
    ws = split_workspace(step, ("mla", num_heads, max_splits), num_heads, KV_LORA_RANK, max_splits, q.device)
    acc, locks = accumulator_pool(q.device)
    q = aligned_rows(q)
    tables = step["tables"]
    p = params(
        kernels.PagedAttentionParams, q=q.data_ptr(), q_stride_token=row_stride(q), q_stride_head=row_stride(q, 1),
        k_cache=kv_cache.data_ptr(), v_cache=kv_cache.data_ptr(), out=out.data_ptr(), out_stride_token=row_stride(out),
        out_stride_head=row_stride(out, 1), lse=lse.data_ptr() if lse is not None else 0, ws_out=ws[0].data_ptr(),
        ws_lse=ws[1].data_ptr(), ws_start=step["ws_start"].data_ptr(), block_tables=tables.data_ptr(),
        query_start_loc=step["qsl"].data_ptr(), context_lens=step["ctx"].data_ptr(), num_rows=meta.num_rows,
        num_q_heads=num_heads, num_kv_heads=1, head_dim_qk=head_dim, head_dim_v=KV_LORA_RANK,
        block_size=meta.block_size, max_blocks_per_row=tables.shape[1], max_query_len=int(meta.max_query_len),
        max_splits=max_splits, split_block=unit, fixed_splits=fixed, scale=float(scale),
        dtype=DTYPE_CODE[q.dtype], num_sms=num_sms(q.device), mla_small_tile=get_kernel_config().mla_small_tile,
        mla_walk=walk, mla_acc=acc.data_ptr(), mla_acc_floats=acc.numel(), mla_locks=locks.data_ptr(),
        mla_lock_count=locks.numel(),
    )
    with torch.cuda.device(q.device):
        kernels.paged_attention_mla(p, stream(q.device))
    return (out, lse) if return_lse else out
