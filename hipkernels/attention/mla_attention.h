// Paged MLA attention (DeepSeek-V2/V3 absorbed attention: MQA over one latent head): plain C++
// interface; the kernels live in mla_decode_fast.hip / mla_decode_small.hip, launched by
// mla_attention.hip.
//
// Semantics (pyengine/ops/reference/mla.py is the spec):
//   cache [num_blocks, block_size, 576] = [c_kv (512) | k_pe (64)]; q [T, Hq, 576]; out [T, Hq, 512]
//   out[t, h] = softmax_j(scale * q[t, h] . K[j]) @ K[j, :512],  lse[t, h] natural log (+inf, out 0
//   for a query with no keys); query i of a row of q_len attends to keys [0, ctx - (q_len - 1 - i)).
// Summation (the batch-invariant rule of paged_attention.h, in every mode): a query's keys are
// summed in ranges [r U, (r + 1) U), U = split_block, each from a fresh online-softmax state, and the
// ranges' normalised partials merged in range order by merge_range (attention_common.h). Which block
// computes a range is the step's choice (p.mla_walk, mla_ranges.h): one block per range, partials
// in the workspace and the combine's merge, or one block walking a row's ranges with the same merge;
// a query's bits are the same either way, so they depend only on its own keys.
#pragma once

#include "attention/paged_attention.h"

// p as for launch_paged_attention with num_kv_heads 1, head_dim_qk 576, head_dim_v 512, k_cache
// the latent cache (v_cache unused), fixed_splits set, and the accumulator pool (mla_acc,
// mla_locks) holding a slab per resident block. mla_walk: every row walks its ranges (max_splits
// 1); otherwise rows of at most kPagedAttnSplitMaxQueryLen queries and more than one range put
// each range in the workspace (max_splits >= ceil(max_ctx / U)) and longer rows walk. Two tile
// configurations (mla_tile.h), each its own kernel: on sm_90a tensor cores (wgmma, warpgroup
// roles) with ~226 KB of shared memory per block; under hipcc (AMD gfx90a: 64 KB per block) or on a
// device with less shared memory, the small one (57.5 KB, FMA products). p.mla_small_tile forces the
// small one on NVIDIA. Returns 0 on success, -1 for an unsupported configuration, else the
// runtime's error code.
int launch_mla_attention(const PagedAttentionParams& p, void* stream);
