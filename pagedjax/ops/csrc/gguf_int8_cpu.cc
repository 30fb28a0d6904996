// y = x @ W[layer] for a GGUF weight of a 32-value block format (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0) with the activations quantized to int8: integer dot products per block, as an XLA FFI
// custom call (the engine's gguf_activations="int8"; pagedjax/ops/cpu_gguf.py).
//
// Activations (after llama.cpp's Q8_0 activations, quantize_row_q8_0 in ggml-quants.c): each
// row of x is cut into 32-value blocks; block b gets the scale dx_b = max|x| / 127 (0 for an
// all-zero block) and the integers xq = round(x / dx_b) (ties away from zero), |xq| <= 127,
// with their sum s_b. Done once per call, before the work is spread.
//
// Weights: block b of an output row holds 32 unsigned integers u (a nibble, a nibble with its
// fifth bit, or, for Q8_0, the signed byte + 128) with w = d (u - o) + m, o the format's offset
// (8 for Q4_0, 16 for Q5_0, 128 for Q8_0, else 0) and m its min (Q4_1, Q5_1; else 0). So
//     sum_k w_k x_k ~= sum_b dx_b [d_b (sum_j u_j xq_j - o s_b) + m_b s_b],
// the integer sum exact in int32 (|u xq| <= 255 * 127, 32 terms), the rest in float32.
//
// On AVX-512 with VNNI, two blocks per 512-bit register: the 64 unsigned bytes of the weight
// times the 64 signed bytes of xq by vpdpbusd (16 int32 lanes, 8 per block), the offset taken
// from the first lane of each block, converted and multiplied by [d_b dx_b] lane-wise into a
// float accumulator, its lanes summed in a fixed tree at the end; the min terms are a dot
// product over the row's blocks. Elsewhere (and for a last odd block) the same sums block by
// block in scalar code. Each (m, n) is computed the same way whatever M is (batch invariance),
// and whatever the thread count.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "parallel.h"
#include "simd.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace pagedjax_gguf;

#if defined(PAGEDJAX_ISA_AVX512) && defined(__AVX512VNNI__)
#define PAGEDJAX_GGUF_VNNI 1
#endif

// x quantized: q [M][K] int8, d [M][nb] scales, s [M][nb] integer sums, ds [M][nb] = d * s.
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> s;
};

void QuantizeRows(const float* x, int64_t M, int64_t K, QuantX& out) {
  const int64_t nb = K / 32;
  out.q.resize(M * K);
  out.d.resize(M * nb);
  out.ds.resize(M * nb);
  out.s.resize(M * nb);
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = int(std::round(xb[j] * inv));
      out.q[i * 32 + j] = int8_t(std::clamp(v, -127, 127));
      sum += out.q[i * 32 + j];
    }
    out.d[i] = d;
    out.s[i] = sum;
    out.ds[i] = d * float(sum);
  }
}

template <int64_t T>
constexpr int32_t kOffset = T == Q4_0 ? 8 : T == Q5_0 ? 16 : T == Q8_0 ? 128 : 0;

// Block b's 32 unsigned integers u (values in order) -> u[0:32].
template <int64_t T>
inline void Unsigned32(const uint8_t* b, uint8_t* u) {
  if constexpr (T == Q8_0) {
    for (int j = 0; j < 32; ++j) u[j] = uint8_t(b[2 + j] ^ 0x80);  // int8 + 128
  } else if constexpr (T == Q4_0 || T == Q4_1) {
    const uint8_t* qs = b + (T == Q4_0 ? 2 : 4);
    for (int j = 0; j < 16; ++j) {
      u[j] = qs[j] & 0xF;
      u[j + 16] = qs[j] >> 4;
    }
  } else {
    const uint8_t* hb = b + (T == Q5_0 ? 2 : 4);
    uint32_t qh;
    std::memcpy(&qh, hb, 4);
    const uint8_t* qs = hb + 4;
    for (int j = 0; j < 16; ++j) {
      u[j] = uint8_t((qs[j] & 0xF) | (((qh >> j) & 1) << 4));
      u[j + 16] = uint8_t((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
  }
}

// One block, scalar: d dx (sum u xq - o s).
template <int64_t T>
inline float BlockDot(const uint8_t* b, float d, const int8_t* xq, float dx, int32_t s) {
  uint8_t u[32];
  Unsigned32<T>(b, u);
  int32_t acc = 0;
  for (int j = 0; j < 32; ++j) acc += int32_t(u[j]) * int32_t(xq[j]);
  return d * dx * float(acc - kOffset<T> * s);
}

#if defined(PAGEDJAX_GGUF_VNNI)
// Blocks b and b + 1 -> 64 unsigned bytes, in value order.
template <int64_t T>
inline __m512i Unsigned64(const uint8_t* b) {
  constexpr int64_t B = kBlockBytes<T>;
  if constexpr (T == Q8_0) {
    const __m512i v = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + B + 2)), 1);
    return _mm512_xor_si512(v, _mm512_set1_epi8(char(0x80)));
  } else {
    constexpr int64_t off = (T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8);  // nibbles
    const __m256i both = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + B + off)), 1);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(both, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(both, 4), mask);
    // [lo0 lo1 hi0 hi1] (16 bytes each) -> [lo0 hi0 lo1 hi1]
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    v = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
    if constexpr (T == Q5_0 || T == Q5_1) {
      constexpr int64_t hoff = off - 4;
      uint32_t h0, h1;
      std::memcpy(&h0, b + hoff, 4);
      std::memcpy(&h1, b + B + hoff, 4);
      const __mmask64 fifth = __mmask64(h0) | (__mmask64(h1) << 32);
      v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(fifth, _mm512_set1_epi8(16)));
    }
    return v;
  }
}
#endif

struct Problem {
  const QuantX* xq;
  const uint8_t* w;  // this layer's rows [N][row_bytes]
  float* y;          // [M, N]
  int64_t M, K, N, row_bytes;
  int64_t item_rows;
};

constexpr int MT = 4;  // rows of x per pass over a weight row

// Output rows [n0, n1): for each row n and each pass of up to MT rows of x.
template <int64_t T>
void RunItem(const Problem& p, int64_t n0, int64_t n1, std::vector<float>& scales) {
  const int64_t nb = p.K / 32;
  constexpr int64_t B = kBlockBytes<T>;
  scales.resize(2 * nb + 16);
  float* ds = scales.data();
  float* ms = scales.data() + nb;
  const QuantX& X = *p.xq;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    BlockHalves<B>(row, nb, ds, kHasMin<T> ? ms : nullptr);
    for (int64_t m0 = 0; m0 < p.M; m0 += MT) {
      const int mt = int(std::min<int64_t>(MT, p.M - m0));
      float tail[MT] = {};
      int64_t b = 0;
#if defined(PAGEDJAX_GGUF_VNNI)
      __m512 acc[MT];
      for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
      const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      for (; b + 2 <= nb; b += 2) {
        const __m512i u = Unsigned64<T>(row + b * B);
        double dpair;
        std::memcpy(&dpair, ds + b, 8);
        const __m512 dw = _mm512_permutexvar_ps(half, _mm512_castps128_ps512(_mm_castpd_ps(_mm_set_sd(dpair))));
        for (int m = 0; m < mt; ++m) {
          const int64_t xm = (m0 + m) * nb + b;
          __m512i isum = _mm512_dpbusd_epi32(
              _mm512_setzero_si512(), u,
              _mm512_loadu_si512(X.q.data() + (m0 + m) * p.K + b * 32));
          if constexpr (kOffset<T> != 0) {
            const __m512i s = _mm512_maskz_expandloadu_epi32(0x0101, X.s.data() + xm);
            isum = _mm512_sub_epi32(isum, _mm512_mullo_epi32(s, _mm512_set1_epi32(kOffset<T>)));
          }
          double xpair;
          std::memcpy(&xpair, X.d.data() + xm, 8);
          const __m512 dx = _mm512_permutexvar_ps(half, _mm512_castps128_ps512(_mm_castpd_ps(_mm_set_sd(xpair))));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx), acc[m]);
        }
      }
      for (int m = 0; m < mt; ++m) tail[m] = TreeSum((vf)acc[m]);
#endif
      for (; b < nb; ++b)  // scalar blocks (every block without VNNI)
        for (int m = 0; m < mt; ++m) {
          const int64_t xm = (m0 + m) * nb + b;
          tail[m] += BlockDot<T>(row + b * B, ds[b], X.q.data() + (m0 + m) * p.K + b * 32,
                                 X.d[xm], X.s[xm]);
        }
      for (int m = 0; m < mt; ++m) {
        float y = tail[m];
        if constexpr (kHasMin<T>) {
          const float* xds = X.ds.data() + (m0 + m) * nb;
          float mins = 0.0f;
          for (int64_t c = 0; c < nb; ++c) mins += ms[c] * xds[c];
          y += mins;
        }
        p.y[(m0 + m) * p.N + n] = y;
      }
    }
  }
}

typedef void (*ItemFn)(const Problem&, int64_t, int64_t, std::vector<float>&);

ItemFn ItemFor(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return RunItem<Q4_0>;
    case Q4_1: return RunItem<Q4_1>;
    case Q5_0: return RunItem<Q5_0>;
    case Q5_1: return RunItem<Q5_1>;
    case Q8_0: return RunItem<Q8_0>;
    default: return nullptr;
  }
}

ffi::Error GgufLinearInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                          ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t block_values,
                          int64_t block_bytes) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("gguf int8 linear: bad ranks");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("gguf int8 linear: layer out of range");
  const ItemFn run = ItemFor(qtype);
  if (run == nullptr || block_values != 32)
    return ffi::Error::InvalidArgument("gguf int8 linear: a format of 32-value blocks only");
  Problem p;
  const int64_t total_rows = xd[0];
  p.M = std::clamp<int64_t>(rows.typed_data()[0], 0, total_rows);
  p.K = xd[1];
  p.N = y->dimensions()[1];
  p.row_bytes = wd[2];
  if (wd[1] != p.N || p.K % 32 || p.K / 32 * block_bytes != p.row_bytes)
    return ffi::Error::InvalidArgument("gguf int8 linear: weight shape does not match x and y");
  p.w = w.typed_data() + l * wd[1] * wd[2];
  p.y = y->typed_data();
  std::fill(p.y + p.M * p.N, p.y + total_rows * p.N, 0.0f);  // padding rows
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  thread_local QuantX xq;  // reused call to call: no allocation in a step
  QuantizeRows(x.typed_data(), p.M, p.K, xq);
  p.xq = &xq;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  p.item_rows = 16 * std::clamp<int64_t>(p.N / (16 * 8 * threads), 1, 4);
  const int64_t items = (p.N + p.item_rows - 1) / p.item_rows;
  pagedjax::ParallelFor(pool, items, [&p, run](int64_t i) {
    thread_local std::vector<float> scales;
    const int64_t n0 = i * p.item_rows;
    run(p, n0, std::min(p.N, n0 + p.item_rows), scales);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GgufLinearInt8Cpu, GgufLinearInt8,
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
