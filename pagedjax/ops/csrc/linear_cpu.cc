// Dense float32 matmul y = x @ W[layer] on CPU, as an XLA FFI custom call.
//
// Why: inside the model's `lax.scan` over layers, XLA's CPU backend copies each layer's
// weight matrix out of the stacked [L, in, out] array (a dynamic-slice) before every dot; for
// the small-M matmuls of decode steps that copy costs about half as much as the dot itself.
// This kernel takes the whole stacked array and the layer index and reads the layer's rows in
// place.
//
// Algorithm: the blocked GEMM of Goto & van de Geijn ("Anatomy of high-performance matrix
// multiplication", ACM TOMS 2008) in the loop order of BLIS (Van Zee & van de Geijn, 2015),
// reduced to what these shapes need:
//   - W comes pre-packed for every layer, [L][ceil(N / 16)][K][16] (pagedjax/ops/cpu_linear.py
//     `pack`; the engine holds its float32 weights this way under the "cpu" backend): a
//     micro-panel of NR = 16 columns is one sequential stream, which the hardware prefetcher
//     follows, and nothing of W is copied per call;
//   - x [M, K] is packed once per call into micro-panels of MR = 6 rows, k-major
//     (xp[m / 6][k][6], zero rows past M), so the micro-kernel reads it as one stream;
//   - a work item is up to NC = 64 output columns (fewer when W is narrow, so that each
//     thread gets about eight); for each KC = 256 slice of K, each 16 KB slice of a panel
//     stays in L1 while the row blocks of x pass over it, MC = 96 rows at a time so that
//     those stay in L2;
//   - the micro-kernel keeps a 6 x 16 block of y in twelve 8-float registers and does
//     12 fused multiply-adds per k from one 16-float row of W and six broadcasts of x.
// Only the first `rows` rows of x are multiplied (a runtime operand: a step padded to its
// shape bucket passes its number of real tokens); the rows past it are written as zeros.
// Work items are spread over XLA's intra-op thread pool.
//
// Built on first use by pagedjax/ops/cpu_kernels.py (g++ -O3 -march=native).

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t MR = 6;    // rows of x per micro-kernel call
constexpr int64_t NR = 16;   // columns of W per micro-panel
constexpr int64_t KC = 256;  // depth of one slice of a W panel
constexpr int64_t MC = 96;   // rows of x per pass over an item's panels (a multiple of MR)
constexpr int64_t NP = 4;    // micro-panels per work item at most (NC = NP * NR columns)

// y[0:R, 0:16] (+)= xp[0:kc][0:R] @ wp[0:kc][0:16]; ldy is y's row stride.
template <int R>
void Micro(const float* __restrict xp, const float* __restrict wp, int64_t kc, float* __restrict y,
           int64_t ldy, bool accumulate) {
  v8 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = v8{};
  for (int64_t k = 0; k < kc; ++k) {
    const v8 w0 = *reinterpret_cast<const v8*>(wp + NR * k);
    const v8 w1 = *reinterpret_cast<const v8*>(wp + NR * k + 8);
    for (int r = 0; r < R; ++r) {
      const float s = xp[MR * k + r];
      const v8 xs = {s, s, s, s, s, s, s, s};
      acc0[r] += xs * w0;
      acc1[r] += xs * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float* row = y + r * ldy;
    if (accumulate) {
      acc0[r] += Load(row);
      acc1[r] += Load(row + 8);
    }
    Store(row, acc0[r]);
    Store(row + 8, acc1[r]);
  }
}

typedef void (*MicroFn)(const float*, const float*, int64_t, float*, int64_t, bool);
constexpr MicroFn kMicro[MR + 1] = {nullptr,  Micro<1>, Micro<2>, Micro<3>,
                                    Micro<4>, Micro<5>, Micro<6>};

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // this layer's panels [ceil(N / NR)][K][NR]
  float* y;        // [M, N]
  int64_t M, K, N;
  int64_t item_cols;      // output columns per work item (a multiple of NR, <= NP * NR)
  std::vector<float> xp;  // packed x: [ceil(M / MR)][K][MR]
};

void PackX(Problem& p) {
  const int64_t blocks = (p.M + MR - 1) / MR;
  p.xp.assign(blocks * MR * p.K, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    float* dst = p.xp.data() + b * MR * p.K;
    const int64_t rows = std::min(MR, p.M - b * MR);
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = p.x + (b * MR + r) * p.K;
      for (int64_t k = 0; k < p.K; ++k) dst[k * MR + r] = src[k];
    }
  }
}

// Output columns [j0, j0 + cols), cols <= item_cols.
void RunItem(const Problem& p, int64_t j0, int64_t cols) {
  alignas(32) float tile[MR * NR];  // a partial micro-panel's output, before its copy to y
  const int64_t panels = (cols + NR - 1) / NR;
  for (int64_t k0 = 0; k0 < p.K; k0 += KC) {
    const int64_t kc = std::min(KC, p.K - k0);
    for (int64_t mc0 = 0; mc0 < p.M; mc0 += MC) {
      const int64_t mc1 = std::min(p.M, mc0 + MC);
      for (int64_t q = 0; q < panels; ++q) {
        const int64_t c0 = j0 + q * NR;
        const int64_t width = std::min(NR, cols - q * NR);
        const float* panel = p.w + (c0 / NR) * p.K * NR + k0 * NR;
        for (int64_t m0 = mc0; m0 < mc1; m0 += MR) {
          const int64_t rows = std::min(MR, p.M - m0);
          const MicroFn micro = kMicro[rows];
          const float* xp = p.xp.data() + m0 * p.K + k0 * MR;
          float* y = p.y + m0 * p.N + c0;
          if (width == NR) {
            micro(xp, panel, kc, y, p.N, k0 > 0);
          } else {
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c = 0; c < NR; ++c) tile[r * NR + c] = c < width ? y[r * p.N + c] : 0.0f;
            micro(xp, panel, kc, tile, NR, k0 > 0);
            for (int64_t r = 0; r < rows; ++r)
              std::memcpy(y + r * p.N, tile + r * NR, width * sizeof(float));
          }
        }
      }
    }
  }
}

// Column blocks handed out by an atomic counter to the calling thread and to tasks on XLA's
// pool. A task that starts after every block is taken exits without touching the buffers, so
// the caller never waits on a task that has not started.
struct Shared {
  Problem p;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

void Drain(Shared& sh) {
  for (int64_t i; (i = sh.next.fetch_add(1)) < sh.items;) {
    const int64_t j0 = i * sh.p.item_cols;
    RunItem(sh.p, j0, std::min(sh.p.item_cols, sh.p.N - j0));
    if (sh.done.fetch_add(1) + 1 == sh.items) {
      std::lock_guard<std::mutex> lock(sh.mu);
      sh.cv.notify_all();
    }
  }
}

ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4) return ffi::Error::InvalidArgument("linear: bad ranks");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("linear: layer out of range");
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->p;
  const int64_t total_rows = xd[0];
  p.M = std::clamp<int64_t>(rows.typed_data()[0], 0, total_rows);
  p.K = xd[1];
  p.N = y->dimensions()[1];
  if (wd[2] != p.K || wd[3] != NR || wd[1] * NR < p.N)
    return ffi::Error::InvalidArgument("linear: bad pre-packed weight shape");
  p.x = x.typed_data();
  p.w = w.typed_data() + l * wd[1] * wd[2] * wd[3];
  p.y = y->typed_data();
  std::fill(p.y + p.M * p.N, p.y + total_rows * p.N, 0.0f);  // padding rows
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {
    std::fill(p.y, p.y + p.M * p.N, 0.0f);
    return ffi::Error::Success();
  }
  PackX(p);
  // Narrow items when W has few columns, so that every thread gets several (load balance).
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  p.item_cols = NR * std::clamp<int64_t>(p.N / (NR * 8 * threads), 1, NP);
  shared->items = (p.N + p.item_cols - 1) / p.item_cols;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), shared->items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { Drain(*shared); });
  Drain(*shared);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == shared->items; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearCpu, Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [L, ceil(N / 16), K, 16]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows []: rows of x to multiply
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
