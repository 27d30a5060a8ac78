// A tiny pool for the CPU GEMM: the calling thread plus persistent workers, woken by a generation
// counter. Workers spin briefly between jobs (decode issues a GEMM every few tens of microseconds,
// and a futex wake-up costs about as much as a small GEMM) and then sleep on a condition variable,
// so an idle engine leaves the other cores alone. Recreated after fork().
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pyengine::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads), pid_(getpid()) {
    for (int t = 1; t < num_threads_; ++t) workers_.emplace_back([this, t] { work(t); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }
  pid_t pid() const { return pid_; }

  // Runs fn(thread_index, num_threads) on every thread of the pool, the caller being thread 0.
  // Callers are serialised: the GEMM binding releases the GIL, so two Python threads (two engines)
  // can arrive here at once, and the job slot holds one job.
  void run(const std::function<void(int, int)>& fn) {
    if (num_threads_ == 1) return fn(0, 1);
    std::lock_guard<std::mutex> caller(run_mutex_);
    job_ = &fn;
    pending_.store(num_threads_ - 1);
    generation_.fetch_add(1);  // seq_cst: pairs with the workers' sleeping_ store (no lost wake-up)
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    fn(0, num_threads_);
    while (pending_.load(std::memory_order_acquire) != 0) __builtin_ia32_pause();
  }

 private:
  void work(int index) {
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
      if (stop_) return;
      (*job_)(index, num_threads_);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int num_threads_;
  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  const std::function<void(int, int)>* job_ = nullptr;
  bool stop_ = false;
};

// The process-wide pool of the CPU ops (GEMM, attention, activations), made on first use with the
// count set_pool_threads() gave (1 until then), and again after a fork().
ThreadPool& shared_pool();
void set_pool_threads(int num_threads);

// Index range [begin, end) of part t of n when `count` items are split into `parts` near-equal ranges.
inline int64_t split_begin(int64_t count, int t, int parts) { return count * t / parts; }

}  // namespace pyengine::cpu
