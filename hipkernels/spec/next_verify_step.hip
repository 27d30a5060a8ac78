// next_verify_step (next_verify_step.h): one block per row accepts, appends to the history and
// drafts (the host's prediction where it held, else prompt lookup: every candidate start of an
// n-gram tested in parallel, the latest match kept); then one block packs the rows into the
// graph's static inputs, which needs every row's draft count first.
#include "common/hip_compat.h"
#include "spec/next_verify_step.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxN = 64;  // the longest n-gram looked up (launch_next_verify_step refuses more)

__global__ void __launch_bounds__(kThreads) accept_and_draft_kernel(NextVerifyStepParams p) {
  const int64_t r = blockIdx.x;
  const int64_t* in = p.rows_in + r * (kRowFields + 2 * p.max_drafts + 1);
  const int64_t* drafts_in = in + kRowFields;
  int32_t* hist = p.history + in[kHistoryRow] * p.history_stride;
  int64_t* out = p.result + r * p.result_stride;

  const int32_t* sync = p.sync_tokens + in[kSyncOffset];
  for (int64_t j = threadIdx.x; j < in[kSyncCount]; j += kThreads) hist[in[kSyncFrom] + j] = sync[j];
  __syncthreads();

  __shared__ int64_t s_num_tokens, s_limit, s_best;
  __shared__ int32_t s_suffix[kMaxN];
  const int64_t p0 = in[kFirstPosition];
  if (threadIdx.x == 0) {
    const int64_t start = in[kPrevStart], d = in[kPrevDrafts];
    int64_t a = 0;
    while (a < d && drafts_in[a] == p.argmax[start + a]) ++a;
    const int64_t bonus = p.argmax[start + a];
    for (int64_t j = 0; j < a; ++j) hist[p0 + 1 + j] = static_cast<int32_t>(drafts_in[j]);
    hist[p0 + 1 + a] = static_cast<int32_t>(bonus);
    // after the bonus token: as many drafts as leave the row a token to end on, and no more than
    // its table's blocks and the context limit hold
    const int64_t first = p0 + 1 + a, left = in[kTokensLeft] - a - 1;
    int64_t limit = in[kMaxDrafts] < p.q - 1 ? in[kMaxDrafts] : p.q - 1;  // the graph's rows hold q tokens
    limit = left < 2 ? 0 : (limit < left - 1 ? limit : left - 1);
    const int32_t* table = p.block_tables + r * p.table_width;
    int64_t ok = 0;
    while (ok < limit) {
      const int64_t pos = first + 1 + ok, col = pos / p.block_size;
      if (pos + 1 > p.max_context || col >= p.table_width || table[col] < 0) break;
      ++ok;
    }
    out[0] = a;
    out[2] = bonus;
    s_num_tokens = first + 1;
    s_limit = ok;
  }
  __syncthreads();
  const int64_t m = s_num_tokens, limit = s_limit;
  if (p.phase == kAccept) {  // a drafting layer drafts next (next_verify_step.h)
    if (threadIdx.x == 0) out[1] = limit;
    return;
  }
  const int64_t* predicted = drafts_in + p.max_drafts;
  int64_t count = 0;
  const bool held = out[0] == in[kPrevDrafts] && in[kPredicted] > 1 && predicted[0] == out[2];
  if (held && limit > 0) {  // every draft kept and the bonus token guessed: the host's drafts
    count = limit < in[kPredicted] - 1 ? limit : in[kPredicted] - 1;
    for (int64_t j = threadIdx.x; j < count; j += kThreads) out[3 + j] = predicted[1 + j];
  }
  for (int64_t n = (p.max_n < m - 1 ? p.max_n : m - 1); !count && limit > 0 && p.min_n > 0 && n >= p.min_n; --n) {
    if (threadIdx.x < n) s_suffix[threadIdx.x] = hist[m - n + threadIdx.x];
    if (threadIdx.x == 0) s_best = 0;  // 1 + the latest matching start, 0: none
    __syncthreads();
    int64_t best = -1;
    for (int64_t s = threadIdx.x; s + n < m; s += kThreads) {  // a match leaves a token after it
      bool same = true;
      for (int64_t i = 0; i < n && same; ++i) same = hist[s + i] == s_suffix[i];
      if (same) best = s;
    }
    if (best >= 0)
      atomicMax(reinterpret_cast<unsigned long long*>(&s_best), static_cast<unsigned long long>(best + 1));
    __syncthreads();
    const int64_t found = s_best - 1;
    __syncthreads();  // s_best and s_suffix are rewritten for the next n
    if (found >= 0) {
      const int64_t follow = found + n;
      count = limit < m - follow ? limit : m - follow;
      for (int64_t j = threadIdx.x; j < count; j += kThreads) out[3 + j] = hist[follow + j];
      break;
    }
  }
  if (threadIdx.x == 0) out[1] = count;
}

// kLayerDrafts: row r's first result[r][1] drafts from the layer's [draft][row] buffer.
__global__ void __launch_bounds__(kThreads) take_layer_drafts_kernel(NextVerifyStepParams p) {
  const int64_t r = blockIdx.x;
  int64_t* out = p.result + r * p.result_stride;
  for (int64_t j = threadIdx.x; j < out[1]; j += kThreads) out[3 + j] = p.layer_drafts[j * p.layer_stride + r];
}

__global__ void __launch_bounds__(kThreads) stage_next_step_kernel(NextVerifyStepParams p) {
  int64_t* ids = p.inputs;
  int64_t* pos = p.inputs + p.token_capacity;
  int64_t* slots = p.inputs + 2 * p.token_capacity;
  int64_t* ctx = p.inputs + 3 * p.token_capacity;
  int64_t* qsl = ctx + p.row_capacity;
  __shared__ int64_t s_n;
  if (threadIdx.x == 0) {
    int64_t n = 0;
    qsl[0] = 0;
    for (int64_t r = 0; r < p.rows; ++r) {
      n += 1 + p.result[r * p.result_stride + 1];
      qsl[r + 1] = n;
    }
    for (int64_t r = p.rows; r < p.padded_rows; ++r) {
      const int64_t end = n + p.q * (r - p.rows + 1);
      qsl[r + 1] = end < p.token_slots ? end : p.token_slots;
    }
    s_n = n;
  }
  __syncthreads();
  for (int64_t r = threadIdx.x; r < p.rows; r += kThreads) {
    const int64_t* in = p.rows_in + r * (kRowFields + 2 * p.max_drafts + 1);
    const int64_t* res = p.result + r * p.result_stride;
    const int64_t first = in[kFirstPosition] + 1 + res[0], count = 1 + res[1], at = qsl[r];
    const int32_t* table = p.block_tables + r * p.table_width;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t position = first + j;
      const int32_t block = table[position / p.block_size];
      ids[at + j] = j == 0 ? res[2] : res[2 + j];
      pos[at + j] = position;
      slots[at + j] = block < 0 ? -1 : static_cast<int64_t>(block) * p.block_size + position % p.block_size;
    }
    ctx[r] = first + count;
  }
  for (int64_t t = s_n + threadIdx.x; t < p.token_slots; t += kThreads) {
    ids[t] = 0;
    pos[t] = 0;
    slots[t] = -1;  // no KV write
  }
  for (int64_t r = p.rows + threadIdx.x; r < p.padded_rows; r += kThreads) ctx[r] = 0;  // no keys read
}

}  // namespace

int launch_next_verify_step(const NextVerifyStepParams& p, void* stream) {
  if (p.rows < 1 || p.padded_rows < p.rows || p.padded_rows > p.row_capacity || p.q < 1 ||
      p.q - 1 > p.max_drafts || p.token_slots > p.token_capacity || p.rows * p.q > p.token_slots ||
      p.result_stride < 3 + p.max_drafts || p.min_n < 0 || p.max_n < p.min_n || p.max_n > kMaxN ||
      p.block_size < 1 || p.phase < kWhole || p.phase > kLayerDrafts ||
      (p.phase == kLayerDrafts && (p.layer_drafts == nullptr || p.layer_stride < p.rows)))
    return -1;
  const peStream_t s = static_cast<peStream_t>(stream);
  if (p.phase == kLayerDrafts)
    take_layer_drafts_kernel<<<dim3((unsigned)p.rows), kThreads, 0, s>>>(p);
  else
    accept_and_draft_kernel<<<dim3((unsigned)p.rows), kThreads, 0, s>>>(p);
  if (p.phase != kAccept) stage_next_step_kernel<<<1, kThreads, 0, s>>>(p);
  return static_cast<int>(peGetLastError());
}
