// Work spread over XLA's intra-op thread pool, shared by the native CPU kernels.
//
// ParallelFor(pool, n, fn) runs fn(i) for i in [0, n): the indices are handed out by an
// atomic counter to the calling thread and to num_threads - 1 tasks scheduled on the pool.
// A task that starts after every index is taken exits without touching anything, so the
// caller never waits on a task that has not started (a pool of one thread cannot deadlock).
//
// When the caller runs out of indices while a task still runs one, it yields the core
// (sched_yield) in a loop for up to kSpinMicros before it sleeps on the condition variable,
// so that it sees the last index finish without a futex wake-up. (A decode step calls a
// kernel about 250 times, each call tens of microseconds; a two-thread GGUF matmul of 16K
// weights, about 1 us of compute, took 8-16 us a call. Against sleeping at once, in one
// process on 2 cores shared with a build, the median per call was 14.5 vs 14.8 us for that
// call, 57 vs 63 us for 576 x 576 weights, 147 vs 155 us for 1536 x 576: within noise.)
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace pagedjax {

constexpr int64_t kSpinMicros = 200;

inline void CpuRelax() { sched_yield(); }

template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  if (n <= 0) return;
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  auto drain = [st, n, &fn] {
    for (int64_t i; (i = st->next.fetch_add(1)) < n;) {
      fn(i);
      if (st->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(st->mu);
        st->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = drain;
    pool.Schedule(std::move(task));
  }
  drain();
  if (st->done.load() == n) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  for (int spins = 0; st->done.load(std::memory_order_acquire) != n; ++spins) {
    CpuRelax();
    if ((spins & 63) == 63 && std::chrono::steady_clock::now() > until) {
      std::unique_lock<std::mutex> lock(st->mu);
      st->cv.wait(lock, [&] { return st->done.load() == n; });
      return;
    }
  }
}

}  // namespace pagedjax
