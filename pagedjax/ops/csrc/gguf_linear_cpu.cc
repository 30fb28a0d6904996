// y = x @ W[layer] for a weight kept in a GGUF block format, on CPU, as an XLA FFI custom call.
//
// W is a stacked GGUF weight, uint8 [L][N][row_bytes]: row n holds the K inputs of output n
// in blocks, as llama.cpp stores a tensor (formats and their layouts: pagedjax/ops/gguf_quant.py,
// after ggml's ggml-common.h). x is float32 [M, K], y float32 [M, N]; the float32 weights
// are never materialised: each work item dequantizes NB = 4 rows of W at a time into a small
// float buffer (4 K floats, in L1/L2) and multiplies them with every row of x before it moves
// on, so a step reads each weight block once, whatever M. Accumulation is in float32.
//
// Dot products: a register block of MB rows of x by NB rows of W (MB = 4 with 32 vector
// registers, 2 with 16) keeps MB * NB vector accumulators over K and sums each one's lanes in
// a fixed order at the end (`HSum`), so the result does not depend on the thread count.
// Vector width comes from simd.h (AVX-512, AVX2 or the portable 4-float path, one build each).
//
// Only the first `rows` rows of x are multiplied (a step padded to its shape bucket passes its
// number of real tokens); the others are written as zeros. Work items (a range of output
// rows) are spread over XLA's intra-op thread pool. Built by pagedjax/ops/cpu_kernels.py.

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

constexpr int NB = 4;                     // rows of W dequantized together
constexpr int MB = kVecRegs >= 32 ? 4 : 2;  // rows of x per register block

// ggml's type ids (pagedjax/ops/gguf_quant.py GGML_TYPE_IDS).
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// IEEE half (little-endian bytes) -> float, normals, subnormals, inf and NaN.
inline float Half(const uint8_t* p) {
  const uint32_t h = uint32_t(p[0]) | (uint32_t(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    float f = float(man) * (1.0f / 16777216.0f);  // man * 2^-24
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline void ScaleMinK4(int j, const uint8_t* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One row of K values -> out[0:K]. The inner loops have fixed trip counts and no branches,
// so the compiler vectorizes them.
template <int64_t T>
void DequantRow(const uint8_t* __restrict b, int64_t K, float* __restrict out) {
  if constexpr (T == Q8_0) {
    for (int64_t i = 0; i < K / 32; ++i, b += 34, out += 32) {
      const float d = Half(b);
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int l = 0; l < 32; ++l) out[l] = d * float(q[l]);
    }
  } else if constexpr (T == Q4_0 || T == Q4_1) {
    constexpr int64_t bytes = T == Q4_0 ? 18 : 20;
    for (int64_t i = 0; i < K / 32; ++i, b += bytes, out += 32) {
      const float d = Half(b);
      const float m = T == Q4_1 ? Half(b + 2) : -8.0f * d;
      const uint8_t* qs = b + (T == Q4_0 ? 2 : 4);
      for (int l = 0; l < 16; ++l) {
        out[l] = d * float(qs[l] & 0xF) + m;
        out[l + 16] = d * float(qs[l] >> 4) + m;
      }
    }
  } else if constexpr (T == Q5_0 || T == Q5_1) {
    constexpr int64_t bytes = T == Q5_0 ? 22 : 24;
    for (int64_t i = 0; i < K / 32; ++i, b += bytes, out += 32) {
      const float d = Half(b);
      const float m = T == Q5_1 ? Half(b + 2) : -16.0f * d;
      const uint8_t* hb = b + (T == Q5_0 ? 2 : 4);
      const uint32_t qh = uint32_t(hb[0]) | (uint32_t(hb[1]) << 8) | (uint32_t(hb[2]) << 16) |
                          (uint32_t(hb[3]) << 24);
      const uint8_t* qs = hb + 4;
      for (int l = 0; l < 16; ++l) {
        const int lo = (qs[l] & 0xF) | (((qh >> l) & 1) << 4);
        const int hi = (qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        out[l] = d * float(lo) + m;
        out[l + 16] = d * float(hi) + m;
      }
    }
  } else if constexpr (T == Q4_K || T == Q5_K) {
    constexpr int64_t bytes = T == Q4_K ? 144 : 176;
    for (int64_t i = 0; i < K / 256; ++i, b += bytes, out += 256) {
      const float d = Half(b), dmin = Half(b + 2);
      const uint8_t* s = b + 4;
      const uint8_t* qh = b + 16;  // Q5_K only
      const uint8_t* qs = b + (T == Q4_K ? 16 : 48);
      for (int j = 0; j < 4; ++j) {
        int sc0, mn0, sc1, mn1;
        ScaleMinK4(2 * j, s, &sc0, &mn0);
        ScaleMinK4(2 * j + 1, s, &sc1, &mn1);
        const float d0 = d * sc0, m0 = dmin * mn0, d1 = d * sc1, m1 = dmin * mn1;
        const uint8_t* q = qs + 32 * j;
        float* o = out + 64 * j;
        for (int l = 0; l < 32; ++l) {
          int lo = q[l] & 0xF, hi = q[l] >> 4;
          if constexpr (T == Q5_K) {
            lo |= ((qh[l] >> (2 * j)) & 1) << 4;
            hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
          }
          o[l] = d0 * float(lo) - m0;
          o[l + 32] = d1 * float(hi) - m1;
        }
      }
    }
  } else if constexpr (T == Q6_K) {
    for (int64_t i = 0; i < K / 256; ++i, b += 210, out += 256) {
      const float d = Half(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        float* o = out + 128 * h;
        const int8_t* s = sc + 8 * h;
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          o[l] = d * float(s[is]) * float(q1);
          o[l + 32] = d * float(s[is + 2]) * float(q2);
          o[l + 64] = d * float(s[is + 4]) * float(q3);
          o[l + 96] = d * float(s[is + 6]) * float(q4);
        }
      }
    }
  }
}

typedef void (*DequantFn)(const uint8_t*, int64_t, float*);

DequantFn Dequantizer(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return DequantRow<Q4_0>;
    case Q4_1: return DequantRow<Q4_1>;
    case Q5_0: return DequantRow<Q5_0>;
    case Q5_1: return DequantRow<Q5_1>;
    case Q8_0: return DequantRow<Q8_0>;
    case Q4_K: return DequantRow<Q4_K>;
    case Q5_K: return DequantRow<Q5_K>;
    case Q6_K: return DequantRow<Q6_K>;
    default: return nullptr;
  }
}

// y[m0 + r, n0 + j] = dot(x[m0 + r, :], w[j, :]) for r < R, j < J (w: J dequantized rows).
template <int R, int J>
inline void Block(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
                  float* __restrict y, int64_t ldy) {
  vf acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = vf{};
  for (int64_t k = 0; k < K; k += kVecFloats) {
    vf wv[J];
    for (int j = 0; j < J; ++j) wv[j] = VLoad(w + j * K + k);
    for (int r = 0; r < R; ++r) {
      const vf xv = VLoad(x + r * ldx + k);
      for (int j = 0; j < J; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) y[r * ldy + j] = HSum(acc[r][j]);
}

template <int J>
void RowsTimesX(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + MB <= M; m += MB) Block<MB, J>(x + m * K, K, w, K, y + m * N, N);
  for (; m < M; ++m) Block<1, J>(x + m * K, K, w, K, y + m * N, N);
}

struct Problem {
  const float* x;    // [M, K]
  const uint8_t* w;  // this layer's rows [N][row_bytes]
  float* y;          // [M, N]
  int64_t M, K, N, row_bytes;
  int64_t item_rows;  // output rows per work item (a multiple of NB)
  DequantFn dequant;
};

void RunItem(const Problem& p, int64_t n0, int64_t n1, std::vector<float>& buf) {
  buf.resize(NB * p.K);
  for (int64_t n = n0; n < n1; n += NB) {
    const int64_t rows = std::min<int64_t>(NB, n1 - n);
    for (int64_t j = 0; j < rows; ++j) p.dequant(p.w + (n + j) * p.row_bytes, p.K, &buf[j * p.K]);
    float* y = p.y + n;
    switch (rows) {
      case 4: RowsTimesX<4>(p.x, p.M, p.K, buf.data(), y, p.N); break;
      case 3: RowsTimesX<3>(p.x, p.M, p.K, buf.data(), y, p.N); break;
      case 2: RowsTimesX<2>(p.x, p.M, p.K, buf.data(), y, p.N); break;
      default: RowsTimesX<1>(p.x, p.M, p.K, buf.data(), y, p.N); break;
    }
  }
}

// Row ranges handed out by an atomic counter to the calling thread and to tasks on XLA's
// pool; a task that starts after every item is taken exits without touching the buffers.
struct Shared {
  Problem p;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

void Drain(Shared& sh) {
  std::vector<float> buf;
  for (int64_t i; (i = sh.next.fetch_add(1)) < sh.items;) {
    const int64_t n0 = i * sh.p.item_rows;
    RunItem(sh.p, n0, std::min(sh.p.N, n0 + sh.p.item_rows), buf);
    if (sh.done.fetch_add(1) + 1 == sh.items) {
      std::lock_guard<std::mutex> lock(sh.mu);
      sh.cv.notify_all();
    }
  }
}

ffi::Error GgufLinear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                      ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t block_values,
                      int64_t block_bytes) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3) return ffi::Error::InvalidArgument("gguf linear: bad ranks");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("gguf linear: layer out of range");
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->p;
  const int64_t total_rows = xd[0];
  p.M = std::clamp<int64_t>(rows.typed_data()[0], 0, total_rows);
  p.K = xd[1];
  p.N = y->dimensions()[1];
  p.row_bytes = wd[2];
  p.dequant = Dequantizer(qtype);
  if (p.dequant == nullptr) return ffi::Error::InvalidArgument("gguf linear: unknown qtype");
  if (wd[1] != p.N || p.K % block_values || p.K % kVecFloats ||
      p.K / block_values * block_bytes != p.row_bytes)
    return ffi::Error::InvalidArgument("gguf linear: weight shape does not match x and y");
  p.x = x.typed_data();
  p.w = w.typed_data() + l * wd[1] * wd[2];
  p.y = y->typed_data();
  std::fill(p.y + p.M * p.N, p.y + total_rows * p.N, 0.0f);  // padding rows
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  // About eight items per thread (load balance), at least NB rows and at most 64 each.
  p.item_rows = NB * std::clamp<int64_t>(p.N / (NB * 8 * threads), 1, 16);
  shared->items = (p.N + p.item_rows - 1) / p.item_rows;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), shared->items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { Drain(*shared); });
  Drain(*shared);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == shared->items; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GgufLinearCpu, GgufLinear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w [L, N, row_bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows []: rows of x to multiply
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("block_values")
                                  .Attr<int64_t>("block_bytes"));
