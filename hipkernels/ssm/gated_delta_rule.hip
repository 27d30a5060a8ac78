// Gated DeltaNet decode / verify update (base state + per-token records), the prefill recurrence
// (final state only) and the materialisation of base + records. Semantics, record layout and the
// race argument in gated_delta_rule.h (reference: pyengine/ops/reference/gdn.py). All arithmetic
// in fp32.
//
// Work items are (row, value head, tile of kGdnRecordRows value rows): 8 warps of 4 value rows of
// S^T [V, K]; a group of 8 lanes owns one value row, each lane KC 16-byte chunks of it (lane sub of
// the group: entries (sub + 8 j) * 4 .. + 3, so a group reads a row's 128-byte segments whole; K
// contiguous in the pool), held in registers across the row's tokens. Per item the block stages in
// shared memory the row's tokens (q and k l2-normalised once per block, k . q, decay, beta, the
// tile's v) and the records it replays, replays them, then per token reads out from the state
// before the token's update:
//   S^T k and S^T q in one pass (independent partial sums per chunk, then one 8-lane butterfly for
//   both), delta = beta (v - decay S^T k), o = decay S^T q + delta (k . q), S = S decay + k delta^T
// so the token's critical path holds one reduction, not two. The base (token 0) or the token's
// record (tokens >= 1) is stored.
// Two launches of the same item code. When the items outnumber what the device holds at once
// (K <= 128), a persistent grid: each block walks a contiguous range of items, copies the next
// item's base into shared memory (cp.async, double-buffered) while it computes this one, and keeps
// q / k across the items of one key head (the per-item work, not the arithmetic per state entry, is
// what a verify step's instructions were mostly spent on: docs/kernels/gdn.md). Otherwise one block
// per item, the base loaded straight into registers (batch 1 latency). 64 registers, < 48 KB of
// shared memory: 4 blocks (32 warps) per SM.
// A row's arithmetic never depends on the other rows or on how many tokens share its step: token t
// of a verify row gets the bits the same token gets decoded alone, and a replayed record the bits
// its token computed (the same device functions, explicit __fmul_rn / fmaf, no contraction left to
// the compiler).
#include "common/hip_compat.h"
#include "ssm/gated_delta_rule.h"

#include <atomic>

#include "common/async_copy.h"
#include "ssm/gated_delta_rule_device.h"

namespace {

using namespace pe_gdn;

constexpr int kMinBlocks = 4;  // blocks per SM the K <= 128 kernel is built for (64 registers)

// The next item's base, copied by each thread into its own 16-byte chunks ([buffer][chunk][thread]).
template <int KC, bool kPrefetch>
struct BaseBuffers {
  float4 f[2][KC][kThreads];
};
template <int KC>
struct BaseBuffers<KC, false> {};

// A work item (row n, value head hv, tile of value rows), with its key head hk and hv's place g in
// the key head's group of value heads, so that stepping to the next item divides nothing.
struct Item {
  int n, hv, tile, hk, g;
};

PE_DEVICE Item item_at(int it, int tiles, int HV, int group) {  // items < 2^31 (launch checks)
  const int head_row = it / tiles, hv = head_row % HV;
  return {head_row / HV, hv, it % tiles, hv / group, hv % group};
}

PE_DEVICE void next_item(Item& x, int tiles, int HV, int group) {
  if (++x.tile < tiles) return;
  x.tile = 0;
  if (++x.g == group) x.g = 0, ++x.hk;
  if (++x.hv == HV) x.hv = 0, x.hk = 0, x.g = 0, ++x.n;
}

// The slot row n's base is read from, or -1 when it starts from zeros (or is a PAD row).
PE_DEVICE int base_slot(const GatedDeltaRuleParams& p, int n) {
  const int slot = p.state_idx[(int64_t)n * p.slots_per_row];
  const bool init = !p.final_state_only || p.has_initial_state == nullptr || p.has_initial_state[n];
  return init ? slot : -1;
}

// This thread's chunks of the item's base into buf (cp.async; chunks past K or V are left alone
// and never read).
template <int KC>
PE_DEVICE void prefetch_base(float4 (&buf)[KC][kThreads], const GatedDeltaRuleParams& p, const Item& x, int slot) {
  const int lane = threadIdx.x % kLanes, sub = lane % kGroup, tile_row = threadIdx.x / kLanes * kRows + lane / kGroup;
  const int vr = x.tile * kGdnRecordRows + tile_row, K = p.key_dim;
  if (slot < 0 || vr >= p.value_dim) return;
  const float* row = p.state + (int64_t)slot * p.num_v_heads * p.value_dim * K + ((int64_t)x.hv * p.value_dim + vr) * K;
  if (chunk_k0(sub, KC - 1) < K) {  // every chunk (K = 128): one address, constant offsets
#pragma unroll
    for (int j = 0; j < KC; ++j) pe_copy::copy16_async(&buf[j][threadIdx.x], row + chunk_k0(sub, j), true);
  } else {
#pragma unroll
    for (int j = 0; j < KC; ++j)
      if (chunk_k0(sub, j) < K) pe_copy::copy16_async(&buf[j][threadIdx.x], row + chunk_k0(sub, j), true);
  }
}

// Outputs of tokens c0 .. c0 + nt - 1 and, for decode / verify rows, the records of tokens >= 1 (k and
// decay from the staged token, the tile's deltas), from shared memory: token c0 + tt by warp tt % 8,
// a lane per value row and 16-byte pieces of the record. Each piece comes from the same fp32 values
// the token's update used.
template <typename T, int KC>
PE_DEVICE void write_tokens(const GatedDeltaRuleParams& p, const Staged<KC>& st, const Item& x, const int32_t* idx,
                            int s0, int c0, int nt, int64_t rec_off) {
  constexpr int kc = Staged<KC>::kMaxK / (kLanes * 4);
  const int lane = threadIdx.x % kLanes, warp = threadIdx.x / kLanes;
  const int K = p.key_dim, V = p.value_dim, vr = x.tile * kGdnRecordRows + lane;
  for (int tt = warp; tt < nt; tt += kWarps) {
    const int t = c0 + tt;
    if (vr < V) Io<T>::st(static_cast<T*>(p.out) + ((int64_t)(s0 + t) * p.num_v_heads + x.hv) * V + vr, st.o[tt][lane]);
    const int dst = p.final_state_only || t == 0 || t >= p.slots_per_row ? -1 : idx[t];
    if (dst < 0) continue;
    float* rec = p.state + (int64_t)dst * p.num_v_heads * V * K + rec_off;
#pragma unroll
    for (int j = 0; j < kc; ++j) {
      const int k0 = (lane + j * kLanes) * 4;
      if (k0 < K) *reinterpret_cast<float4*>(rec + k0) = *reinterpret_cast<const float4*>(&st.k[tt][k0]);
    }
    if (lane < kGdnRecordRows / 4)
      *reinterpret_cast<float4*>(rec + K + 4 * lane) = *reinterpret_cast<const float4*>(&st.delta[tt][4 * lane]);
    if (lane == 0) rec[K + kGdnRecordRows] = st.decay[tt];
  }
}

// One work item, start to end. buf: the item's base copied by prefetch_base (its copy group the
// second newest of this thread), or null to load it here.
// staged_qk: the (row, key head) whose q and k the shared memory holds (-1: none), updated.
template <typename T, int KC>
PE_DEVICE void run_item(const GatedDeltaRuleParams& p, Staged<KC>& st, const float4 (*buf)[kThreads], const Item& x,
                        int& staged_qk) {
  const int lane = threadIdx.x % kLanes, warp = threadIdx.x / kLanes;
  const int sub = lane % kGroup, tile_row = warp * kRows + lane / kGroup;  // the lane's row in the tile
  const int tile = x.tile, hv = x.hv, n = x.n;
  const int K = p.key_dim, V = p.value_dim, HV = p.num_v_heads;
  const int vr = tile * kGdnRecordRows + tile_row;  // the lane's value row
  const bool row_ok = vr < V;  // lanes past V compute zeros (and still meet the barriers)
  const bool materialise = p.replay_dst != nullptr;
  const int s0 = materialise ? 0 : p.query_start_loc[n];
  const int num = materialise ? 0 : p.query_start_loc[n + 1] - s0;
  const int32_t* idx = p.state_idx + (int64_t)n * p.slots_per_row;
  if (idx[0] < 0) {  // the whole block skips the item
    if (sub == 0 && row_ok)
      for (int t = 0; t < num; ++t) Io<T>::st(static_cast<T*>(p.out) + ((int64_t)(s0 + t) * HV + hv) * V + vr, 0.f);
    return;
  }
  const bool init = !p.final_state_only || p.has_initial_state == nullptr || p.has_initial_state[n];
  const int replays = init ? min(max(p.num_accepted[n], 1), p.slots_per_row) - 1 : 0;  // records idx[1..a-1]
  const int64_t slot_elems = (int64_t)HV * V * K;
  const int64_t rec_off = (int64_t)hv * V * K + (int64_t)tile * (K + kGdnRecordRows + kGdnRecordPad);
  float* base = p.state + idx[0] * slot_elems + ((int64_t)hv * V + vr) * K;  // the lane's value row of the base
  float s[KC][4];
  if (buf == nullptr) {  // the base: every load issued before any is used
#pragma unroll
    for (int j = 0; j < KC; ++j) {
      if (init && row_ok && chunk_k0(sub, j) < K) {
        load4(base + chunk_k0(sub, j), s[j]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[j][i] = 0.f;
      }
    }
  }
  const T* q = static_cast<const T*>(p.q) + (int64_t)x.hk * K;
  const T* k = static_cast<const T*>(p.k) + (int64_t)x.hk * K;
  const T* v = static_cast<const T*>(p.v) + (int64_t)hv * V;
  if (num > 0) {
    const int qk = n * p.num_k_heads + x.hk;
    stage_tokens(st, p, q, k, v, s0, min(num, kTokens), hv, tile, lane, warp, qk != staged_qk || num > kTokens);
    staged_qk = num > kTokens ? -1 : qk;  // a longer row restages its later tokens over these
  }
  if (replays > 0) stage_records(st, p, idx, slot_elems, rec_off, 0, min(replays, kRecords), lane, warp);
  if (buf != nullptr) {  // the base this thread copied (the newest group is the next item's)
    pe_copy::copy_wait<1>();
#pragma unroll
    for (int j = 0; j < KC; ++j) {
      const float4 f = init && row_ok && chunk_k0(sub, j) < K ? buf[j][threadIdx.x] : make_float4(0.f, 0.f, 0.f, 0.f);
      s[j][0] = f.x, s[j][1] = f.y, s[j][2] = f.z, s[j][3] = f.w;
    }
  }
  // tokens and records staged; every record of the previous step is read by the block before this
  // step writes any (the barriers below come before the first store)
  __syncthreads();
  for (int r0 = 0; r0 < replays; r0 += kRecords) {
    if (r0 > 0) {  // more records than shared memory holds: the next ones
      __syncthreads();
      stage_records(st, p, idx, slot_elems, rec_off, r0, min(replays - r0, kRecords), lane, warp);
      __syncthreads();
    }
    for (int r = 0; r < min(replays - r0, kRecords); ++r)
      if (idx[1 + r0 + r] >= 0) replay_record(s, st, r, sub, tile_row, row_ok);
  }
  if (materialise) {
    if (p.replay_dst[n] >= 0 && row_ok)
      store_state(p.state + p.replay_dst[n] * slot_elems + ((int64_t)hv * V + vr) * K, s, K, sub);
    return;
  }
  const int base_t = p.final_state_only ? num - 1 : 0;  // the token whose full state is stored
  for (int c0 = 0; c0 < num; c0 += kTokens) {
    const int nt = min(num - c0, kTokens);
    if (c0 > 0) {  // the row's next tokens: restage once every warp is done with these
      __syncthreads();
      stage_tokens(st, p, q, k, v, s0 + c0, nt, hv, tile, lane, warp, true);
      __syncthreads();
    }
    for (int tt = 0; tt < nt; ++tt) {
      float kk[KC][4], qq[KC][4];
      load_staged(kk, st.k[tt], sub);
      load_staged(qq, st.q[tt], sub);
      const float decay = st.decay[tt];
      // both reductions from the state before the token: S^T k for delta, S^T q for the output
      float mk = dot_part(s, kk), mq = dot_part(s, qq);
      group_sum2(mk, mq);
      const float delta = __fmul_rn(st.beta[tt], __fsub_rn(st.v[tt][tile_row], __fmul_rn(decay, mk)));
      decay_state(s, decay);
      add_update(s, kk, delta);
      if (sub == 0) st.o[tt][tile_row] = fmaf(delta, st.kq[tt], __fmul_rn(decay, mq)), st.delta[tt][tile_row] = delta;
      if (c0 + tt == base_t && row_ok) store_state(base, s, K, sub);
    }
    __syncthreads();  // outputs and deltas staged
    write_tokens<T>(p, st, x, idx, s0, c0, nt, rec_off);
  }
}

// Items begin .. end - 1 of an even split. With kPrefetch the next item's base is in flight (into the
// other buffer) while this one computes; the slot it reads is looked up one item earlier still, so
// that issuing the copy never waits on a load.
template <typename T, int KC, bool kPrefetch>
__global__ void __launch_bounds__(kThreads, KC <= 4 ? kMinBlocks : 1) gated_delta_rule_kernel(GatedDeltaRuleParams p) {
  __shared__ __align__(16) Staged<KC> st;
  __shared__ __align__(16) BaseBuffers<KC, kPrefetch> bb;
  const int tiles = (p.value_dim + kGdnRecordRows - 1) / kGdnRecordRows, HV = p.num_v_heads;
  const int group = HV / p.num_k_heads;
  int staged_qk = -1;
  if constexpr (!kPrefetch) {  // one item per block
    run_item<T, KC>(p, st, nullptr, item_at(blockIdx.x, tiles, HV, group), staged_qk);
  } else {
    const int items = tiles * HV * p.num_rows, share = items / gridDim.x, extra = items % gridDim.x;
    const int begin = blockIdx.x * share + min((int)blockIdx.x, extra), end = begin + share + ((int)blockIdx.x < extra);
    Item x = item_at(begin, tiles, HV, group), next = x;
    next_item(next, tiles, HV, group);
    if (begin < end) prefetch_base(bb.f[0], p, x, base_slot(p, x.n));
    pe_copy::copy_commit();
    int next_slot = begin + 1 < end ? base_slot(p, next.n) : -1;
    for (int it = begin; it < end; ++it) {
      Item after = next;
      next_item(after, tiles, HV, group);
      const int b = (it - begin) & 1;
      if (it + 1 < end) prefetch_base(bb.f[b ^ 1], p, next, next_slot);
      pe_copy::copy_commit();  // a group per item, empty or not: copy_wait<1> then means "this item's"
      next_slot = it + 2 < end ? base_slot(p, after.n) : -1;
      run_item<T, KC>(p, st, bb.f[b], x, staged_qk);
      __syncthreads();  // every warp done with this item's staged values (and base buffer) before reuse
      x = next, next = after;
    }
  }
}

// Blocks of `kernel` the device holds at once (multiprocessors x resident blocks), per device; 0 if
// unknown.
template <typename Kernel>
int device_blocks(Kernel kernel) {
  constexpr int kDevices = 64;
  static std::atomic<int> cache[kDevices];
  int dev = 0, sms = 0, per_sm = 0;
#if defined(PE_HIP)
  if (hipGetDevice(&dev) != hipSuccess || dev < 0 || dev >= kDevices) return 0;
  if (const int v = cache[dev].load(std::memory_order_relaxed)) return v;
  if (hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, dev) != hipSuccess ||
      hipOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != hipSuccess)
    return 0;
#else
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kDevices) return 0;
  if (const int v = cache[dev].load(std::memory_order_relaxed)) return v;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess)
    return 0;
#endif
  cache[dev].store(sms * per_sm, std::memory_order_relaxed);
  return sms * per_sm;
}

template <typename T>
int launch(const GatedDeltaRuleParams& p, peStream_t stream) {
  const int64_t items = (int64_t)(p.value_dim + kGdnRecordRows - 1) / kGdnRecordRows * p.num_v_heads * p.num_rows;
  if (items > INT32_MAX) return -1;
  if (p.key_dim <= 4 * kGroup * 4) {  // K <= 128: half the registers
    const int resident = device_blocks(gated_delta_rule_kernel<T, 4, true>);
    if (resident > 0 && items > resident)
      gated_delta_rule_kernel<T, 4, true><<<resident, kThreads, 0, stream>>>(p);
    else
      gated_delta_rule_kernel<T, 4, false><<<(int)items, kThreads, 0, stream>>>(p);
  } else {
    gated_delta_rule_kernel<T, kMaxChunks, false><<<(int)items, kThreads, 0, stream>>>(p);
  }
  return static_cast<int>(peGetLastError());
}

bool aligned(const void* ptr, int64_t stride_elems, int elem_bytes) {  // 4 elements: one 8- or 16-byte load
  return reinterpret_cast<uintptr_t>(ptr) % (4 * elem_bytes) == 0 && stride_elems % 4 == 0;
}

bool supported(const GatedDeltaRuleParams& p) {
  const int tiles = (p.value_dim + kGdnRecordRows - 1) / kGdnRecordRows;
  return p.key_dim > 0 && p.key_dim <= kGdnMaxKeyDim && p.key_dim % 4 == 0 && p.value_dim > 0 &&
         p.num_k_heads > 0 && p.num_v_heads % p.num_k_heads == 0 && reinterpret_cast<uintptr_t>(p.state) % 16 == 0 &&
         p.slots_per_row >= 1 && (int64_t)tiles * gdn_record_width(p.key_dim) <= (int64_t)p.value_dim * p.key_dim;
}

}  // namespace

int launch_gated_delta_rule_update(const GatedDeltaRuleParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  if (!supported(p) || (!p.final_state_only && p.slots_per_row > kGdnMaxTokens)) return -1;
  const int elem = p.dtype == PE_FLOAT32 ? 4 : 2;  // q / k rows are read 4 elements at a time
  if (!aligned(p.q, p.q_stride_token, elem) || !aligned(p.k, p.k_stride_token, elem)) return -1;
  const peStream_t s = static_cast<peStream_t>(stream);
  switch (p.dtype) {
    case PE_FLOAT32: return launch<float>(p, s);
    case PE_FLOAT16: return launch<pe_half>(p, s);
    case PE_BFLOAT16: return launch<pe_bf16>(p, s);
    default: return -1;
  }
}

int launch_gated_delta_rule_prefill(const GatedDeltaRuleParams& p, void* stream) {
  GatedDeltaRuleParams q = p;
  q.final_state_only = true;
  q.replay_dst = nullptr;
  return launch_gated_delta_rule_update(q, stream);
}

int launch_gated_delta_rule_materialise(const GatedDeltaRuleParams& p, void* stream) {
  if (p.num_rows == 0) return 0;
  if (!supported(p) || p.replay_dst == nullptr) return -1;
  GatedDeltaRuleParams q = p;
  q.final_state_only = false;
  return launch<float>(q, static_cast<peStream_t>(stream));
}
