// Launchers of the two MLA decode kernels (internal to hipkernels/attention; the public entry is
// launch_mla_attention in mla_attention.h, which picks one and runs the combine).
#pragma once

#include "common/hip_compat.h"
#include "attention/paged_attention.h"

// Both return 0 on success, -1 when the accumulator pool is too small for the kernel's resident
// blocks (mla_ranges.h), else the runtime's error code.
#if !defined(PE_HIP)
int launch_mla_fast(const PagedAttentionParams& p, peStream_t s);  // mla_decode_fast.hip (sm_90a)
#endif
int launch_mla_small(const PagedAttentionParams& p, peStream_t s);  // mla_decode_small.hip

// Shared by both launchers: sets the kernel's shared memory, checks the pool against the blocks
// that can be resident at once, and launches grid (pair tiles, max_splits or 1, rows).
int launch_mla_grid(void (*kernel)(PagedAttentionParams), int m_tile, int threads, int smem,
                    const PagedAttentionParams& p, peStream_t s);
