// When the CPU pool (cpu_thread_pool.h) should stop handing work to its workers for a while.
//
// A job's chunks are claimed dynamically, so a worker that is not scheduled before the job starts
// costs nothing. One that claims a chunk and is then preempted (another process takes its core)
// holds the caller until the kernel runs it again: a scheduler time slice, milliseconds, against
// decode jobs of tens of microseconds. Two threads then decode far slower than one. The pool
// therefore notes such a stall (the caller's wait for workers much longer than its own share of
// the job) and runs jobs on the caller alone for a while, probing again later. The quiet period
// doubles with each stall, so a core that stays busy costs one stall per kMaxSoloUs; a stretch of
// kCleanUs without a stall restores the short period, so a burst of load costs little afterwards.
// Which thread runs a chunk never changes a result (cpu_thread_pool.h), so neither does this.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pyengine::cpu {

class SoloBackoff {
 public:
  static constexpr int64_t kStallSlackUs = 200;  // wake-ups and cache misses stay well below this
  static constexpr int64_t kMinSoloUs = 10'000;
  static constexpr int64_t kMaxSoloUs = 500'000;
  static constexpr int64_t kCleanUs = 50'000;

  // Whether a parallel job whose caller spent own_us on its chunks and then waited_us for the
  // workers' chunks in progress was held up by a descheduled worker rather than by its share.
  static bool stalled(int64_t own_us, int64_t waited_us) { return waited_us > own_us + kStallSlackUs; }

  // Whether a job starting at now_us (a monotonic clock) may use the workers.
  bool parallel(int64_t now_us) const { return now_us >= solo_until_us_; }

  // After a parallel job that ended at now_us.
  void on_parallel_job(int64_t now_us, bool was_stalled) {
    if (was_stalled) {
      solo_until_us_ = now_us + solo_us_;
      solo_us_ = std::min(2 * solo_us_, kMaxSoloUs);
      clean_since_us_ = -1;
      return;
    }
    if (clean_since_us_ < 0) clean_since_us_ = now_us;
    if (now_us - clean_since_us_ >= kCleanUs) solo_us_ = kMinSoloUs;
  }

  int64_t solo_us() const { return solo_us_; }  // the quiet period the next stall starts

 private:
  int64_t solo_until_us_ = 0;
  int64_t solo_us_ = kMinSoloUs;
  int64_t clean_since_us_ = -1;
};

}  // namespace pyengine::cpu
