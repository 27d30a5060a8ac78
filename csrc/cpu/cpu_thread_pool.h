// A tiny pool for the CPU GEMM: the calling thread plus persistent workers, woken by a generation
// counter. Workers spin briefly between jobs (decode issues a GEMM every few tens of microseconds,
// and a futex wake-up costs about as much as a small GEMM) and then sleep on a condition variable,
// so an idle engine leaves the other cores alone. Recreated after fork().
//
// A job is n chunks claimed one at a time from an atomic counter by whichever thread gets there
// first, the caller included: each chunk runs exactly once, on any thread. The caller waits only
// for chunks in progress, never for a worker that has not started: on a machine whose cores are
// shared with other processes, a worker that is not scheduled no longer holds every step up by a
// time slice (its chunks are taken by the threads that run). Callers must therefore compute
// nothing that depends on which thread runs a chunk (the CPU ops' results never do). A worker
// preempted inside a chunk still holds the caller up, and workers rarely on a core cost the caller
// its share of one; the pool then runs jobs on the caller alone for a while (adaptive, the
// default: cpu_pool_policy.h).
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_pool_policy.h"

namespace pyengine::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads)
      : num_threads_(num_threads < 1 ? 1 : num_threads), pid_(getpid()), backoff_(num_threads_) {
    for (int t = 1; t < num_threads_; ++t) workers_.emplace_back([this, t] { work(t); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }
  pid_t pid() const { return pid_; }

  // Off: every job uses the workers however long they keep the caller waiting (the old pool).
  void set_adaptive(bool on) { adaptive_.store(on); }
  // Workers below this fraction of their fair share of a window's chunks count as absent
  // (cpu_pool_policy.h); 0: only stalls send jobs to the caller alone.
  void set_absent_fraction(double f) {
    std::lock_guard<std::mutex> caller(run_mutex_);
    backoff_.set_absent_fraction(f);
  }

  struct Stats {
    int64_t parallel_jobs = 0;  // jobs handed to the workers
    int64_t solo_jobs = 0;      // jobs the caller ran alone while the workers were held back
    int64_t stalls = 0;         // parallel jobs held up by a descheduled worker
    int64_t chunks = 0;         // chunks of the parallel jobs
    int64_t worker_chunks = 0;  // of those, run by the workers
    int64_t solo_periods = 0;   // times the policy held the workers back
  };
  Stats stats() {
    std::lock_guard<std::mutex> caller(run_mutex_);
    Stats s = stats_;
    s.solo_periods = backoff_.solo_periods();
    return s;
  }

  // Runs fn(i) for every i in [0, n), each once, spread over the pool's threads (the caller too);
  // returns when all have finished. Callers are serialised: the GEMM binding releases the GIL, so
  // two Python threads (two engines) can arrive here at once, and the job slot holds one job.
  void run_chunks(int64_t n, const std::function<void(int64_t)>& fn) {
    if (n <= 0) return;
    if (num_threads_ == 1 || n == 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> caller(run_mutex_);
    const int64_t start = now_us();
    if (adaptive_.load(std::memory_order_relaxed) && !backoff_.parallel(start)) {
      ++stats_.solo_jobs;
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    ++stats_.parallel_jobs;
    Job job{&fn, n};
    current_.store(&job);
    generation_.fetch_add(1);  // seq_cst: pairs with the workers' sleeping_ store (no lost wake-up)
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    const int64_t own_chunks = execute(job);
    // Every chunk is claimed. A worker may still run one: it announced itself (active_) before
    // reading current_, so after the store below no worker can reach `job` unannounced.
    current_.store(nullptr);
    const int64_t own = now_us() - start;
    for (int i = 0; active_.load() != 0; ++i) {
      __builtin_ia32_pause();
      // Stalled: that worker waits for a core. Sleeping frees this one, where the kernel can move it.
      if ((i & 63) == 63 && SoloBackoff::stalled(own, now_us() - start - own))
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    const int64_t end = now_us();
    const bool stalled = SoloBackoff::stalled(own, end - start - own);
    stats_.stalls += stalled;
    stats_.chunks += n, stats_.worker_chunks += n - own_chunks;
    backoff_.on_parallel_job(end, stalled, n, n - own_chunks);
  }

  // Runs fn(t, num_threads) for t in [0, num_threads): run_chunks with one chunk per thread.
  void run(const std::function<void(int, int)>& fn) {
    const int nt = num_threads_;
    run_chunks(nt, [&](int64_t t) { fn(static_cast<int>(t), nt); });
  }

 private:
  struct Job {
    const std::function<void(int64_t)>* fn;
    int64_t n;
    std::atomic<int64_t> next{0};
  };

  static int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  // Runs chunks until none is left unclaimed; returns how many this thread ran.
  static int64_t execute(Job& job) {
    int64_t ran = 0;
    for (int64_t i; (i = job.next.fetch_add(1)) < job.n; ++ran) (*job.fn)(i);
    return ran;
  }

  void work(int /*index*/) {
    uint64_t seen = 0;
    for (;;) {
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      uint64_t gen;
      for (int i = 0; (gen = generation_.load(std::memory_order_acquire)) == seen; ++i) {
        __builtin_ia32_pause();
        if ((i & 255) == 255 && std::chrono::steady_clock::now() > spin_until) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      seen = gen;
      if (stop_.load()) return;
      active_.fetch_add(1);
      if (Job* job = current_.load()) execute(*job);  // null: the job ended before this worker ran
      active_.fetch_sub(1);
    }
  }

  const int num_threads_;
  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<Job*> current_{nullptr};
  std::atomic<int> active_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> adaptive_{true};
  SoloBackoff backoff_;  // under run_mutex_, like stats_
  Stats stats_;
};

// The process-wide pool of the CPU ops (GEMM, attention, activations), made on first use with the
// count set_pool_threads() gave (1 until then), and again after a fork().
ThreadPool& shared_pool();
void set_pool_threads(int num_threads);
// Whether the shared pool holds its workers back after a stall (cpu_pool_policy.h); default on.
void set_pool_adaptive(bool on);
// Below which fraction of their fair share workers count as absent (cpu_pool_policy.h); 0: never.
void set_pool_absent_fraction(double f);

// Index range [begin, end) of part t of n when `count` items are split into `parts` near-equal ranges.
inline int64_t split_begin(int64_t count, int t, int parts) { return count * t / parts; }

}  // namespace pyengine::cpu
