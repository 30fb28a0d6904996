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
//
// ParallelRanges(pool, n, fn) runs fn(i, end) for i in [0, n) for kernels that stream memory in
// index order (the GGUF matmuls at decode sizes): [0, n) is cut into one contiguous range per
// thread, which its thread walks forward, so that what a thread reads next follows what it
// read (fn may prefetch up to `end`, the back of the range it walks); a thread done with its
// range takes indices from the back of the others' (then end = i + 1). Against ParallelFor's
// interleaved indices, a 576 x 3072 Q4_1 matmul at M = 1 on 2 spinning threads over 90 layers
// in turn (a harness): 16-row items 127-147 us, 64-row items 90-106 us, two halves 79-92 us;
// in the engine, see gguf_linear_cpu.cc and linear_cpu.cc. Each index runs once; the ranges
// (thread t: [t n / T, (t + 1) n / T)) are claimed through one atomic word each.
//
// Threads(pool) is how many threads a kernel call spreads its work over: the pool's, capped
// by the process-wide ThreadLimit() (0: no cap), which Python sets through
// PagedjaxSetThreadLimit (linear_cpu.cc; `cpu_kernels.set_thread_limit`) to leave cores to
// other work of the process. Every kernel reads it once per call, and its
// work items split rows, columns or heads only, never a reduction, so a call's bits do not
// depend on it.
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

// The cap on the threads of each kernel call; 0: the pool's. One per library (inline).
inline std::atomic<int64_t>& ThreadLimit() {
  static std::atomic<int64_t> limit{0};
  return limit;
}

// The threads a kernel call uses: the pool's, capped by ThreadLimit(), at least 1.
inline int64_t Threads(xla::ffi::ThreadPool& pool) {
  const int64_t limit = ThreadLimit().load(std::memory_order_relaxed);
  const int64_t n = pool.num_threads();
  return std::max<int64_t>(limit > 0 ? std::min(n, limit) : n, 1);
}

// Returns once done == n: yields the core for up to kSpinMicros, then sleeps on cv (whoever
// makes done reach n notifies it under mu).
inline void AwaitDone(const std::atomic<int64_t>& done, int64_t n, std::mutex& mu,
                      std::condition_variable& cv) {
  if (done.load() == n) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  for (int spins = 0; done.load(std::memory_order_acquire) != n; ++spins) {
    CpuRelax();
    if ((spins & 63) == 63 && std::chrono::steady_clock::now() > until) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return done.load() == n; });
      return;
    }
  }
}

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
  const int64_t helpers = std::min<int64_t>(Threads(pool), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = drain;
    pool.Schedule(std::move(task));
  }
  drain();
  AwaitDone(st->done, n, st->mu, st->cv);
}

template <typename Fn>
void ParallelRanges(xla::ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  if (n <= 0) return;
  const int64_t T = std::min<int64_t>(Threads(pool), std::min<int64_t>(n, 64));
  if (T == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, n);
    return;
  }
  // Range t is [front, back) packed as front << 32 | back; one cache line each.
  struct alignas(64) Range {
    std::atomic<uint64_t> fb;
  };
  struct State {
    std::unique_ptr<Range[]> ranges;
    std::atomic<int64_t> claimed{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  st->ranges.reset(new Range[T]);
  for (int64_t t = 0; t < T; ++t)
    st->ranges[t].fb.store((uint64_t(t * n / T) << 32) | uint64_t((t + 1) * n / T));
  auto finish = [st, n](int64_t count) {
    if (st->done.fetch_add(count) + count == n) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->cv.notify_all();
    }
  };
  auto walk = [st, n, T, &fn, finish] {
    // Unclaimed ranges, forward from their front; then single indices from the others' backs.
    for (int64_t t; (t = st->claimed.fetch_add(1)) < T;) {
      std::atomic<uint64_t>& fb = st->ranges[t].fb;
      for (uint64_t v = fb.load();;) {
        const uint64_t f = v >> 32, b = v & 0xffffffffu;
        if (f >= b) break;
        if (!fb.compare_exchange_weak(v, ((f + 1) << 32) | b)) continue;
        fn(int64_t(f), int64_t(b));
        finish(1);
        v = fb.load();
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      std::atomic<uint64_t>& fb = st->ranges[t].fb;
      for (uint64_t v = fb.load();;) {
        const uint64_t f = v >> 32, b = v & 0xffffffffu;
        if (f >= b) break;
        if (!fb.compare_exchange_weak(v, (f << 32) | (b - 1))) continue;
        fn(int64_t(b - 1), int64_t(b));
        finish(1);
        v = fb.load();
      }
    }
  };
  for (int64_t i = 1; i < T; ++i) {
    auto task = walk;
    pool.Schedule(std::move(task));
  }
  walk();
  AwaitDone(st->done, n, st->mu, st->cv);
}

}  // namespace pagedjax
