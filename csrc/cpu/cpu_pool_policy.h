// When the CPU pool (cpu_thread_pool.h) should stop handing work to its workers for a while.
//
// Two ways a busy machine makes two threads decode slower than one:
//  - Stall: a worker claims a chunk and is preempted (another process takes its core). The caller
//    waits until the kernel runs it again: a time slice, milliseconds, against decode jobs of tens
//    of microseconds.
//  - Absent workers: the workers are rarely on a core while the caller is (each thread gets a
//    fraction of a core when other processes share them). Chunks are claimed dynamically, so the
//    caller then runs nearly every chunk itself, but the runnable workers still count against its
//    share: with autogroup scheduling (one group per session) a process's threads split one
//    group's weight, so a worker spinning or queued for a core halves the caller's. Measured on the
//    shared 2-core VM with two other sessions busy: 2 threads 12-14 tok/s, 1 thread 15-21.
// The pool therefore notes a stall (the caller's wait for workers much longer than its own share
// of the job) and, over each window of kWindowJobs parallel jobs, how many chunks the workers ran;
// after a stall, or a window where they ran under half their fair share, it runs jobs on the
// caller alone for a while (the workers go to sleep, off the run queue), probing again later. The
// quiet period doubles with each such event, so a machine that stays busy costs one probe per
// kMaxSoloUs; a stretch of kCleanUs without one restores the short period, so a burst of load
// costs little afterwards. Which thread runs a chunk never changes a result (cpu_thread_pool.h),
// so neither does this.
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
  static constexpr int64_t kWindowJobs = 64;  // about half a decode step of a 30-layer model

  // num_threads: the pool's (the caller included); the workers' fair share of a job's chunks is
  // (num_threads - 1) / num_threads.
  explicit SoloBackoff(int num_threads = 2) : num_threads_(std::max(num_threads, 2)) {}

  // Workers are absent below this fraction of their fair share; 0: never.
  void set_absent_fraction(double f) { absent_fraction_ = f; }

  // Whether a parallel job whose caller spent own_us on its chunks and then waited_us for the
  // workers' chunks in progress was held up by a descheduled worker rather than by its share.
  static bool stalled(int64_t own_us, int64_t waited_us) { return waited_us > own_us + kStallSlackUs; }

  // Whether workers that ran worker_chunks of a window's `chunks` ran under half their fair share.
  bool absent(int64_t chunks, int64_t worker_chunks) const {
    return static_cast<double>(num_threads_) * worker_chunks < absent_fraction_ * (num_threads_ - 1) * chunks;
  }

  // Whether a job starting at now_us (a monotonic clock) may use the workers.
  bool parallel(int64_t now_us) const { return now_us >= solo_until_us_; }

  // After a parallel job that ended at now_us, of `chunks` chunks, worker_chunks of them run by workers.
  void on_parallel_job(int64_t now_us, bool was_stalled, int64_t chunks = 0, int64_t worker_chunks = 0) {
    window_chunks_ += chunks, window_worker_chunks_ += worker_chunks;
    bool quiet_workers = false;
    if (++window_jobs_ == kWindowJobs) {
      quiet_workers = absent(window_chunks_, window_worker_chunks_);
      window_jobs_ = window_chunks_ = window_worker_chunks_ = 0;
    }
    if (was_stalled || quiet_workers) {
      solo_until_us_ = now_us + solo_us_;
      solo_us_ = std::min(2 * solo_us_, kMaxSoloUs);
      clean_since_us_ = -1;
      window_jobs_ = window_chunks_ = window_worker_chunks_ = 0;  // the next window starts with the probe
      ++solo_periods_;
      return;
    }
    if (clean_since_us_ < 0) clean_since_us_ = now_us;
    if (now_us - clean_since_us_ >= kCleanUs) solo_us_ = kMinSoloUs;
  }

  int64_t solo_us() const { return solo_us_; }  // the quiet period the next event starts
  int64_t solo_periods() const { return solo_periods_; }

 private:
  int num_threads_;
  double absent_fraction_ = 0.5;
  int64_t solo_until_us_ = 0;
  int64_t solo_us_ = kMinSoloUs;
  int64_t clean_since_us_ = -1;
  int64_t window_jobs_ = 0, window_chunks_ = 0, window_worker_chunks_ = 0;
  int64_t solo_periods_ = 0;
};

}  // namespace pyengine::cpu
