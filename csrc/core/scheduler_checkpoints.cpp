// Scheduler, recurrent-state checkpoints of hybrid models with prefix caching (state_checkpoints.h):
// where prefill chunks end, and which states a step leaves at checkpoint positions.
#include <algorithm>

#include "scheduler.h"

namespace pyengine {

int64_t Scheduler::prefill_chunk(const Sequence& seq, int64_t budget) const {
  const int64_t remaining = seq.num_tokens() - seq.num_computed;
  int64_t chunk = std::min(remaining, budget);
  if (checkpoints_states() && config_.enable_chunked_prefill) {
    const int64_t interval = config_.state_checkpoint_interval;
    const int64_t next = (seq.num_computed / interval + 1) * interval;
    if (next < seq.num_tokens()) chunk = std::min(chunk, next - seq.num_computed);
  }
  return chunk;
}

void Scheduler::queue_checkpoints(const Row& row, int64_t old_num_computed) {
  // The step computed the inputs at [old_num_computed, num_computed): the state after input p is
  // the state at position p + 1. A verify row wrote the state after its input t to slot t (conv
  // window at offset t); a prefill chunk only its final state, to slot 0 at offset 0.
  Sequence& seq = *row.seq;
  const int64_t interval = config_.state_checkpoint_interval, B = config_.block_size;
  const std::vector<int32_t>& slots = seq.kv.state_slots;
  // Positions up to the committed tokens only: a stop inside an accepted run leaves inputs past it.
  const int64_t last = std::min(seq.num_computed, seq.num_tokens());
  if (row.is_decode) {
    for (int64_t p = (old_num_computed / interval + 1) * interval; p <= last; p += interval) {
      const auto t = static_cast<int32_t>(p - 1 - old_num_computed);
      checkpoint_candidates_.push_back({&seq, p / B - 1, slots[t], slots[0], t});
    }
  } else if (seq.num_computed % interval == 0) {
    checkpoint_candidates_.push_back({&seq, seq.num_computed / B - 1, slots[0], slots[0], 0});
  }
}

}  // namespace pyengine
