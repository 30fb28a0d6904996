// Work spread over XLA's intra-op thread pool, shared by the native CPU kernels.
//
// ParallelFor(pool, n, fn) runs fn(i) for i in [0, n): the indices are handed out by an
// atomic counter to the calling thread and to num_threads - 1 tasks scheduled on the pool.
// A task that starts after every index is taken exits without touching anything, so the
// caller never waits on a task that has not started (a pool of one thread cannot deadlock).
//
// When the caller runs out of indices while a task still runs one, it spins (with the
// processor's pause hint) for up to kSpinMicros before it sleeps on a condition variable: a
// decode step calls a kernel about 250 times, each call a few tens of microseconds, and
// waking a sleeping thread costs several microseconds on a virtual machine (measured: a
// 16K-weight GGUF matmul on two threads took 12.9 us a call with the sleep alone, the
// compute about 1 us).
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

#ifndef PAGEDJAX_SPIN_MICROS
#define PAGEDJAX_SPIN_MICROS 200
#endif
constexpr int64_t kSpinMicros = PAGEDJAX_SPIN_MICROS;

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
