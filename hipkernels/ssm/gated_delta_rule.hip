// Gated DeltaNet decode / verify update (base state + per-token records), the prefill recurrence
// (final state only) and the materialisation of base + records. Semantics, record layout and the
// race argument in gated_delta_rule.h (reference: pyengine/ops/reference/gdn.py). All arithmetic
// in fp32.
//
// Work items are (row, value head, tile of kGdnRecordRows value rows) of S^T [V, K]; a group of 8
// lanes owns R adjacent value rows, each lane the same KC 16-byte chunks of each (lane sub of the
// group: entries (sub + 8 j) * 4 .. + 3, so a group reads a row's 128-byte segments whole; K
// contiguous in the pool), held in registers across the row's tokens. R = 2 (4 warps of 8 rows): the
// k / q chunks and per-token scalars a lane loads serve two rows. R = 1 (8 warps of 4 rows): half a
// warp's instructions per token, for steps the device holds whole that way (batch <= 2 at Qwen3-Next's
// widths, 2 blocks of 256 threads per SM). A row's arithmetic is the same in both. Per item the block stages in shared
// memory the row's tokens (q and k l2-normalised once per block, k . q, decay, beta, the tile's v)
// and the records it replays, replays them, then per token reads out from the state before the
// token's update:
//   S^T k and S^T q of both rows in one pass (a chain of fused multiply-adds per dot, then one
//   8-lane butterfly for the four: with R = 2 each lane keeps one sum, group_sum_scatter), delta =
//   beta (v - decay S^T k), o = decay S^T q + delta (k . q),
//   S = S decay + k delta^T
// so the token's critical path holds one reduction, not two. The base (token 0) or the token's
// record (tokens >= 1) is stored.
// Two launches of the same item code. When the items outnumber what the device holds at once of
// the direct kernel (K <= 128), a persistent grid: each block walks a contiguous range of items,
// copies the next item's base into shared memory (cp.async; each thread reads back only its own
// copies, so one buffer serves) while it computes this one, and keeps q / k across the items of one
// key head (the per-item and per-token overhead, not the arithmetic per state entry, is what a
// verify step's instructions were mostly spent on: docs/kernels/gdn.md); 94 registers, 32 KB of
// shared memory: 5 blocks (20 warps) per SM. Otherwise (batch <= 4 at Qwen3-Next's widths) one
// block per item, built for latency: the row's metadata loaded first, then the base (cp.async into
// shared memory, K <= 128; else straight into registers), the tokens and the records all in flight
// at once (the tokens' and records' loads issued first, each warp waiting for its own rows of the base
// after the staging barrier), 128 registers (R = 2, 4 blocks per SM; R = 1 at batch <= 2, 2 blocks per SM).
// GatedDeltaRuleParams.grid forces either grid (tests, benchmarks).
// A row's arithmetic never depends on the other rows or on how many tokens share its step: token t
// of a verify row gets the bits the same token gets decoded alone, and a replayed record the bits
// its token computed (the same device functions, explicit __fmul_rn / fmaf, no contraction left to
// the compiler).
#include "common/hip_compat.h"
#include "ssm/gated_delta_rule.h"

#include <algorithm>
#include <atomic>

#include "common/async_copy.h"
#include "ssm/gated_delta_rule_device.h"

namespace {

using namespace pe_gdn;

// Blocks per SM the K <= 128 kernels are built for: the persistent grid 5 (96 registers, no spills);
// one block per item 4 of 128 threads (R = 2) or 2 of 256 (R = 1): up to 128 registers, its staging
// keeps every load of a round in flight (at 4 blocks of 256 threads, 64 registers, R = 1 ran slower).
constexpr int kMinBlocks = 5;
constexpr int min_blocks_direct(int R) { return R == 2 ? 4 : 2; }

// The base of one item, 16-byte chunks in [row][chunk][thread] order (the persistent grid's prefetch,
// the direct grid's cp.async): each thread reads back only the chunks it copied. R KC kThreads chunks,
// the same for either layout (16 KB at K = 128).
template <int KC>
using BaseChunks = float4[2 * KC * Layout<2>::kThreads];

// The next item's base, copied by each thread into its own 16-byte chunks ([row][chunk][thread]):
// only the thread that copies a chunk reads it, so one buffer serves (the copy of the next item's
// base is issued once this thread has read this item's, after a barrier).
template <int KC, bool kPrefetch>
struct BaseBuffers {
  BaseChunks<KC> f;
};
template <int KC>
struct BaseBuffers<KC, false> {};

template <int R>
PE_DEVICE int chunk_slot(int r, int j, int KC) {  // the thread's chunk (r, j) in a BaseChunks buffer
  return (r * KC + j) * Layout<R>::kThreads + threadIdx.x;
}

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
template <int R, int KC>
PE_DEVICE void prefetch_base(float4* buf, const GatedDeltaRuleParams& p, const Item& x, int slot) {
  const int lane = threadIdx.x % kLanes, sub = lane % kGroup;
  const int tile_row = threadIdx.x / kLanes * Layout<R>::kRows + lane / kGroup * R;
  const int vr = x.tile * kGdnRecordRows + tile_row, K = p.key_dim;
  if (slot < 0 || vr >= p.value_dim) return;
  const float* row = p.state + (int64_t)slot * p.num_v_heads * p.value_dim * K + ((int64_t)x.hv * p.value_dim + vr) * K;
  const bool all_rows = vr + R - 1 < p.value_dim;
  if (chunk_k0(sub, KC - 1) < K && all_rows) {  // every chunk of the rows (K = 128): one address, constant offsets
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < KC; ++j)
        pe_copy::copy16_async(&buf[chunk_slot<R>(r, j, KC)], row + r * K + chunk_k0(sub, j), true);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < KC; ++j)
        if (vr + r < p.value_dim && chunk_k0(sub, j) < K)
          pe_copy::copy16_async(&buf[chunk_slot<R>(r, j, KC)], row + r * K + chunk_k0(sub, j), true);
  }
}

// Outputs of tokens c0 .. c0 + nt - 1 and, for decode / verify rows, the records of tokens >= 1 (k and
// decay from the staged token, the tile's deltas), from shared memory: token c0 + tt by warp tt % kWarps,
// a lane per value row and 16-byte pieces of the record. Each piece comes from the same fp32 values
// the token's update used.
template <typename T, int KC, int R>
PE_DEVICE void write_tokens(const GatedDeltaRuleParams& p, const Staged<KC>& st, const Item& x, int s0, int c0, int nt,
                            int64_t rec_off) {
  constexpr int kc = Staged<KC>::kMaxK / (kLanes * 4);
  const int lane = threadIdx.x % kLanes, warp = threadIdx.x / kLanes;
  const int K = p.key_dim, V = p.value_dim, vr = x.tile * kGdnRecordRows + lane;
  for (int tt = warp; tt < nt; tt += Layout<R>::kWarps) {
    const int t = c0 + tt;
    if (vr < V) Io<T>::st(static_cast<T*>(p.out) + ((int64_t)(s0 + t) * p.num_v_heads + x.hv) * V + vr, st.o[tt][lane]);
    const int dst = p.final_state_only || t == 0 || t >= p.slots_per_row ? -1 : st.slot[t];
    if (dst < 0) continue;
    float* rec = p.state + (int64_t)dst * p.num_v_heads * V * K + rec_off;
#pragma unroll
    for (int j = 0; j < kc; ++j) {
      const int k0 = (lane + j * kLanes) * 4;
      if (k0 < K) *reinterpret_cast<float4*>(rec + k0) = *reinterpret_cast<const float4*>(&st.k[tt][k0]);
    }
    if (lane < kGdnRecordRows / 4)
      *reinterpret_cast<float4*>(rec + K + 4 * lane) = *reinterpret_cast<const float4*>(&st.delta[tt][4 * lane]);
    if (lane == 0) rec[K + kGdnRecordRows] = st.tok[tt].x;
  }
}

// Staged tokens c0 .. c0 + nt - 1 on the lane's NR rows from tile_row (both rows of the two-row layout,
// or one row): per token S^T k and S^T q from the state before it, one reduction for all of them,
// delta = beta (v - decay S^T k), o = decay S^T q + delta (k . q), S = S decay + k delta^T; outputs and
// deltas to shared memory, the state after token base_t to base.
template <int NR, int KC>
PE_DEVICE void run_tokens(Rows<NR, KC>& s, Staged<KC>& st, int c0, int nt, int base_t, int sub, int tile_row,
                          float* base, int K, const bool (&ok)[NR]) {
  for (int tt = 0; tt < nt; ++tt) {
    float kk[KC][4], qq[KC][4];
    load_staged(kk, st.k[tt], sub);
    load_staged(qq, st.q[tt], sub);
    const float4 c = st.tok[tt];  // decay, beta, k . q
    float m[2 * NR];  // S^T k of the rows, then S^T q
#pragma unroll
    for (int r = 0; r < NR; ++r) m[r] = dot_part(s[r], kk), m[NR + r] = dot_part(s[r], qq);
    float vv[NR], d[NR];
    load_rows(vv, &st.v[tt][tile_row]);
    if constexpr (NR == 2) {  // lane sub holds sum m[sub / 2 % 4]: the k sums go to every lane, q sums stay
      const float e = group_sum_scatter(m, sub);
      const float mk[2] = {group_lane(e, 0), group_lane(e, 2)};
#pragma unroll
      for (int r = 0; r < NR; ++r) d[r] = __fmul_rn(c.y, __fsub_rn(vv[r], __fmul_rn(c.x, mk[r])));
      decay_state<NR>(s, c.x);
      add_update<NR>(s, kk, d);
      if ((sub & 5) == 4) st.o[tt][tile_row + sub / 2 % 2] = fmaf(sub & 2 ? d[1] : d[0], c.z, __fmul_rn(c.x, e));
      if (sub == 0) store_rows(&st.delta[tt][tile_row], d);
    } else {
      group_sum(m);
#pragma unroll
      for (int r = 0; r < NR; ++r) d[r] = __fmul_rn(c.y, __fsub_rn(vv[r], __fmul_rn(c.x, m[r])));
      decay_state<NR>(s, c.x);
      add_update<NR>(s, kk, d);
      if (sub == 0) {
        float o[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) o[r] = fmaf(d[r], c.z, __fmul_rn(c.x, m[NR + r]));
        store_rows(&st.o[tt][tile_row], o);
        store_rows(&st.delta[tt][tile_row], d);
      }
    }
    if (c0 + tt == base_t) store_state<NR>(base, s, K, sub, ok);
  }
}

// One work item, start to end. buf: the item's base copied by prefetch_base (the thread's only copy
// group in flight), or null to load it here. prefetch_next() is called once on every path, after
// this thread has read buf (behind a barrier): it issues and commits the next item's copy.
// staged_qk: the (row, key head) whose q and k the shared memory holds (-1: none), updated.
template <typename T, int KC, int R, bool kTogether, bool kCopyBase, typename Next>
PE_DEVICE void run_item(const GatedDeltaRuleParams& p, Staged<KC>& st, float4* buf, const Item& x, int& staged_qk,
                        Next prefetch_next) {
  using L = Layout<R>;
  const int lane = threadIdx.x % kLanes, warp = threadIdx.x / kLanes, sub = lane % kGroup;
  const int tile_row = warp * L::kRows + lane / kGroup * R;  // the lane's first row in the tile
  const int tile = x.tile, hv = x.hv, n = x.n;
  const int K = p.key_dim, V = p.value_dim, HV = p.num_v_heads;
  const int vr = tile * kGdnRecordRows + tile_row;  // the lane's first value row
  bool ok[R];  // the lane's rows that exist: lanes past V compute zeros (and still meet the barriers)
#pragma unroll
  for (int r = 0; r < R; ++r) ok[r] = vr + r < V;
  const bool materialise = p.replay_dst != nullptr;
  const int32_t* idx = p.state_idx + (int64_t)n * p.slots_per_row;
  // The row's metadata, every load issued before any is used (then one more latency for the data):
  // nothing branches on it before the data loads are issued (a PAD row stages its tokens too and
  // leaves after), else the compiler sinks the loads used past the branch behind it.
  const int slot0 = idx[0];
  const int s0 = materialise ? 0 : p.query_start_loc[n];
  const int num = materialise ? 0 : p.query_start_loc[n + 1] - s0;
  const int accepted = p.num_accepted[n];
  // The slots of this step's token records, loaded with the metadata and kept in shared memory
  // (a load in write_tokens was an L2 round trip after the tokens, on every verify item's critical
  // path); each thread loads and stores its own entry, unconditionally (a load used only under a
  // branch may be sunk behind the staging's loads).
  const int my_slot = idx[min((int)threadIdx.x, p.slots_per_row - 1)];
  const bool pad = slot0 < 0;  // the whole block skips the item
  const bool init = !pad && (!p.final_state_only || p.has_initial_state == nullptr || p.has_initial_state[n]);
  StageRegs<KC, R> sr;
  record_slots(sr, idx, 0, min(p.slots_per_row - 1, kRecords), warp);  // the first round's, if replayed
  const int replays = init ? min(max(accepted, 1), p.slots_per_row) - 1 : 0;  // records idx[1..a-1]
  const int64_t slot_elems = (int64_t)HV * V * K;
  const int64_t rec_off = (int64_t)hv * V * K + (int64_t)tile * (K + kGdnRecordRows + kGdnRecordPad);
  float* base = p.state + (pad ? 0 : slot0) * slot_elems + ((int64_t)hv * V + vr) * K;  // the lane's first base row
  Rows<R, KC> s;
  // One block per item (kCopyBase): the base into shared memory, issued right after the staging round's
  // loads, and each warp waits for its own rows only after the staging barrier: the tokens and records
  // (records from device memory) no longer queue behind every warp's base, so the barrier passes early
  // and warps whose rows arrive first compute while the others' still load.
  const auto copy_base = [&] {
    prefetch_base<R, KC>(buf, p, x, init ? slot0 : -1);
    pe_copy::copy_commit();
  };
  if (buf == nullptr) {  // the base: every load issued before any is used
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < KC; ++j) {
        if (init && ok[r] && chunk_k0(sub, j) < K) {
          load4(base + r * K + chunk_k0(sub, j), s[r][j]);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[r][j][i] = 0.f;
        }
      }
  }
  const T* q = static_cast<const T*>(p.q) + (int64_t)x.hk * K;
  const T* k = static_cast<const T*>(p.k) + (int64_t)x.hk * K;
  const T* v = static_cast<const T*>(p.v) + (int64_t)hv * V;
  // The first round of tokens and records: all their loads in flight together (with the base's).
  const int qk = n * p.num_k_heads + x.hk;
  const bool with_qk = qk != staged_qk || num > kTokens;
  const int nr = min(replays, kRecords);
#pragma unroll
  for (int u = 0; u < StageRegs<KC, R>::kRec; ++u)
    if (record_of<R>(warp, u) >= nr) sr.rslot[u] = -1;
  stage_round<kTogether>(st, sr, p, q, k, v, s0, min(num, kTokens), nr, hv, tile, slot_elems, rec_off, lane, warp,
                         with_qk, [&] {
                           if constexpr (kCopyBase) copy_base();
                         });
  if (num > 0) staged_qk = num > kTokens ? -1 : qk;  // a longer row restages its later tokens over these
  st.slot[threadIdx.x] = my_slot;  // read after the barriers below
  if (pad) {
    prefetch_next();
    if (sub == 0)
      for (int t = 0; t < num; ++t)
        for (int r = 0; r < R; ++r)
          if (vr + r < V) Io<T>::st(static_cast<T*>(p.out) + ((int64_t)(s0 + t) * HV + hv) * V + vr + r, 0.f);
    return;
  }
  const auto read_base = [&](int r, float (&row)[KC][4]) {  // row r of the base this thread copied
#pragma unroll
    for (int j = 0; j < KC; ++j) {
      const float4 f = init && ok[r] && chunk_k0(sub, j) < K ? buf[chunk_slot<R>(r, j, KC)]
                                                             : make_float4(0.f, 0.f, 0.f, 0.f);
      row[j][0] = f.x, row[j][1] = f.y, row[j][2] = f.z, row[j][3] = f.w;
    }
  };
  if (buf != nullptr && !kCopyBase) {  // the base this thread copied (the persistent grid's prefetch)
    pe_copy::copy_wait<0>();
#pragma unroll
    for (int r = 0; r < R; ++r) read_base(r, s[r]);
  }
  // tokens and records staged (and the base read, persistent grid); every record of the previous step is
  // read by the block before this step writes any (the barriers below come before the first store; a
  // base entry is written only by the thread that copied it, after its copy has landed)
  __syncthreads();
  prefetch_next();
  const int base_t = p.final_state_only ? num - 1 : 0;  // the token whose full state is stored
  if constexpr (kCopyBase) {  // each warp waits for its own rows of the base only
    pe_copy::copy_wait<0>();
#pragma unroll
    for (int r = 0; r < R; ++r) read_base(r, s[r]);
  }
  for (int r0 = 0; r0 < replays; r0 += kRecords) {
    const int nr0 = min(replays - r0, kRecords);
    if (r0 > 0) {  // more records than shared memory holds: the next ones
      __syncthreads();
      record_slots(sr, idx, r0, nr0, warp);
      stage_round<kTogether>(st, sr, p, q, k, v, 0, 0, nr0, hv, tile, slot_elems, rec_off, lane, warp, false, [] {});
      __syncthreads();
    }
    for (int r = 0; r < nr0; ++r)
      if (st.rlive[r]) replay_record<R>(s, st, r, sub, tile_row, ok);
  }
  if (materialise) {
    if (p.replay_dst[n] >= 0)
      store_state<R>(p.state + p.replay_dst[n] * slot_elems + ((int64_t)hv * V + vr) * K, s, K, sub, ok);
    return;
  }
  for (int c0 = 0; c0 < num; c0 += kTokens) {
    const int nt = min(num - c0, kTokens);
    if (c0 > 0) {  // the row's next tokens: restage once every warp is done with these
      __syncthreads();
#pragma unroll
      for (int u = 0; u < StageRegs<KC, R>::kRec; ++u) sr.rslot[u] = -1;
      stage_round<kTogether>(st, sr, p, q, k, v, s0 + c0, nt, 0, hv, tile, slot_elems, rec_off, lane, warp, true, [] {});
      __syncthreads();
    }
    run_tokens<R>(s, st, c0, nt, base_t, sub, tile_row, base, K, ok);
    __syncthreads();  // outputs and deltas staged
    write_tokens<T, KC, R>(p, st, x, s0, c0, nt, rec_off);
  }
}

// Items begin .. end - 1 of an even split. With kPrefetch the next item's base is in flight (into the
// other buffer) while this one computes; the slot it reads is looked up one item earlier still, so
// that issuing the copy never waits on a load.
template <typename T, int KC, int R, bool kPrefetch>
__global__ void __launch_bounds__(Layout<R>::kThreads, KC > 4 ? 1 : kPrefetch ? kMinBlocks : min_blocks_direct(R))
    gated_delta_rule_kernel(GatedDeltaRuleParams p) {
  __shared__ __align__(16) Staged<KC> st;
  __shared__ __align__(16) BaseBuffers<KC, kPrefetch || KC <= 4> bb;  // direct K <= 128: its one base copied
  const int tiles = (p.value_dim + kGdnRecordRows - 1) / kGdnRecordRows, HV = p.num_v_heads;
  const int group = HV / p.num_k_heads;
  int staged_qk = -1;
  if constexpr (!kPrefetch) {  // one item per block
    const Item x = item_at(blockIdx.x, tiles, HV, group);
    if constexpr (KC <= 4)
      run_item<T, KC, R, true, true>(p, st, bb.f, x, staged_qk, [] {});
    else
      run_item<T, KC, R, true, false>(p, st, nullptr, x, staged_qk, [] {});
  } else {
    const int items = tiles * HV * p.num_rows, share = items / gridDim.x, extra = items % gridDim.x;
    const int begin = blockIdx.x * share + min((int)blockIdx.x, extra), end = begin + share + ((int)blockIdx.x < extra);
    Item x = item_at(begin, tiles, HV, group), next = x;
    next_item(next, tiles, HV, group);
    if (begin < end) prefetch_base<R, KC>(bb.f, p, x, base_slot(p, x.n));
    pe_copy::copy_commit();
    int next_slot = begin + 1 < end ? base_slot(p, next.n) : -1;
    for (int it = begin; it < end; ++it) {
      Item after = next;
      next_item(after, tiles, HV, group);
      const bool more = it + 1 < end;
      const int after_slot = it + 2 < end ? base_slot(p, after.n) : -1;  // loaded an item before it is used
      run_item<T, KC, R, false, false>(p, st, bb.f, x, staged_qk, [&] {
        if (more) prefetch_base<R, KC>(bb.f, p, next, next_slot);
        pe_copy::copy_commit();  // a group per item, empty or not
      });
      next_slot = after_slot;
      __syncthreads();  // every warp done with this item's staged values before reuse
      x = next, next = after;
    }
  }
}

// Blocks of `kernel` the device holds at once (multiprocessors x resident blocks), per device; 0 if
// unknown.
template <auto kernel, int threads>  // one cache per kernel (their pointer types are all the same)
int device_blocks() {
  constexpr int kDevices = 64;
  static std::atomic<int> cache[kDevices];
  int dev = 0, sms = 0, per_sm = 0;
#if defined(PE_HIP)
  if (hipGetDevice(&dev) != hipSuccess || dev < 0 || dev >= kDevices) return 0;
  if (const int v = cache[dev].load(std::memory_order_relaxed)) return v;
  if (hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, dev) != hipSuccess ||
      hipOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != hipSuccess)
    return 0;
#else
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kDevices) return 0;
  if (const int v = cache[dev].load(std::memory_order_relaxed)) return v;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess)
    return 0;
#endif
  cache[dev].store(sms * per_sm, std::memory_order_relaxed);
  return sms * per_sm;
}

template <typename T>
int launch(const GatedDeltaRuleParams& p, peStream_t stream) {
  const int64_t items = (int64_t)(p.value_dim + kGdnRecordRows - 1) / kGdnRecordRows * p.num_v_heads * p.num_rows;
  if (items > INT32_MAX) return -1;
  constexpr int t1 = Layout<1>::kThreads, t2 = Layout<2>::kThreads;
  if (p.key_dim <= 4 * kGroup * 4) {  // K <= 128: half the registers
    const int direct = device_blocks<gated_delta_rule_kernel<T, 4, 2, false>, t2>();
    const int direct1 = device_blocks<gated_delta_rule_kernel<T, 4, 1, false>, t1>();
    const int resident = device_blocks<gated_delta_rule_kernel<T, 4, 2, true>, t2>();
    // the persistent grid where the items outnumber what the device holds of the direct kernel at once;
    // one row per lane (R = 1) where the device holds every item of the step at once that way
    const bool persistent = resident > 0 && (p.grid == 2 || (p.grid == 0 && items > direct));
    if (persistent)
      gated_delta_rule_kernel<T, 4, 2, true><<<(int)std::min<int64_t>(resident, items), t2, 0, stream>>>(p);
    else if (items <= direct1)
      gated_delta_rule_kernel<T, 4, 1, false><<<(int)items, t1, 0, stream>>>(p);
    else
      gated_delta_rule_kernel<T, 4, 2, false><<<(int)items, t2, 0, stream>>>(p);
  } else {
    gated_delta_rule_kernel<T, kMaxChunks, 2, false><<<(int)items, t2, 0, stream>>>(p);
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
