// The shared CPU pool (cpu_thread_pool.h).
#include "cpu_thread_pool.h"

#include <algorithm>
#include <memory>

namespace pyengine::cpu {
namespace {

std::mutex pool_mutex;
std::unique_ptr<ThreadPool> pool;
int pool_threads = 1;

}  // namespace

ThreadPool& shared_pool() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (pool && pool->pid() != getpid()) (void)pool.release();  // forked child: its workers are gone
  if (!pool || pool->num_threads() != pool_threads) pool = std::make_unique<ThreadPool>(pool_threads);
  return *pool;
}

void set_pool_threads(int num_threads) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool_threads = std::max(1, num_threads);
}

}  // namespace pyengine::cpu
