// Paged MLA attention (DeepSeek-V2/V3 absorbed attention: MQA over one latent head): plain C++
// interface; the kernels live in mla_attention.hip.
//
// Semantics (pyengine/ops/reference/mla.py is the spec; the split rule and workspace layout are those
// of paged_attention.h, and the split-KV combine is shared with GQA):
//   cache [num_blocks, block_size, 576] = [c_kv (512) | k_pe (64)]; q [T, Hq, 576]; out [T, Hq, 512]
//   out[t, h] = softmax_j(scale * q[t, h] . K[j]) @ K[j, :512],  lse[t, h] natural log (+inf, out 0
//   for a query with no keys); query i of a row of q_len attends to keys [0, ctx - (q_len - 1 - i)).
#pragma once

#include "attention/paged_attention.h"

// p as for launch_paged_attention with num_kv_heads 1, head_dim_qk 576, head_dim_v 512 and k_cache
// the latent cache (v_cache unused). Two tile configurations (mla_tile.h), each its own kernel: on
// sm_90a tensor cores (wgmma, warpgroup roles) with ~226 KB of shared memory per block; under hipcc
// (AMD gfx90a: 64 KB per block) or on a device with less shared memory, the small one (57.5 KB, FMA
// products).
// p.mla_small_tile forces the small one on NVIDIA.
// Returns 0 on success, -1 for an unsupported configuration, else the runtime's error code.
int launch_mla_attention(const PagedAttentionParams& p, void* stream);
