// The shared CPU pool (cpu_thread_pool.h).
#include "cpu_thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <memory>

namespace pyengine::cpu {
namespace {

std::mutex pool_mutex;
std::unique_ptr<ThreadPool> pool;
int pool_threads = 1;
bool pool_adaptive = true;
double pool_absent_fraction = 0.5;
// Set in a forked child (pthread_atfork): the pool's workers did not follow. A flag rather than
// getpid() per call: shared_pool() runs ~150 times a decode step and getpid is a system call.
std::atomic<bool> forked{false};
[[maybe_unused]] const bool fork_handler = [] {
  pthread_atfork(nullptr, nullptr, [] { forked.store(true, std::memory_order_relaxed); });
  return true;
}();

}  // namespace

ThreadPool& shared_pool() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (forked.load(std::memory_order_relaxed)) {
    forked.store(false, std::memory_order_relaxed);
    if (pool && pool->pid() != getpid()) (void)pool.release();  // forked child: its workers are gone
  }
  if (!pool || pool->num_threads() != pool_threads) {
    pool = std::make_unique<ThreadPool>(pool_threads);
    pool->set_adaptive(pool_adaptive);
    pool->set_absent_fraction(pool_absent_fraction);
  }
  return *pool;
}

void set_pool_threads(int num_threads) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool_threads = std::max(1, num_threads);
}

void set_pool_adaptive(bool on) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool_adaptive = on;
  if (pool) pool->set_adaptive(on);
}

void set_pool_absent_fraction(double f) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool_absent_fraction = f;
  if (pool) pool->set_absent_fraction(f);
}

}  // namespace pyengine::cpu
