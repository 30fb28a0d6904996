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
// On AVX-512 with VNNI, two blocks per 512-bit register, in tiles of 4 output rows times up to
// 4 rows of x (each weight pair unpacked once per tile, each activation pair loaded once per
// row of x): the 64 unsigned bytes of the weight times the 64 signed bytes of xq by vpdpbusd
// (16 int32 lanes, 8 per block), the offset o times each lane's activation sum subtracted in
// int32 (exact), converted and multiplied by [d_b dx_b] lane-wise into a float accumulator, the
// min term m_b dx_b (the lane's activation sum) accumulated in the same lanes (activation lane
// sums and scales laid out per pair once per call), the lanes summed in a fixed tree at the
// end; a last odd block in scalar code. (Against one weight row at a time with the min terms
// as a serial scalar sum: 52.5 against 68 us for a 576 x 1536 Q4_1 layer at M = 1, one
// thread.) Elsewhere the same sums block by block in scalar code. Each (m, n) is computed the
// same way whatever M is (batch invariance), and whatever the thread count.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
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
// For the VNNI tiles, per row and pair of blocks (2c, 2c + 1), 16 lanes each (lanes 0-7 block
// 2c, 8-15 block 2c + 1, as vpdpbusd sums them): dl [M][nb / 2][16] the block's scale, sl the
// lane's integer sum of its 4 values, xsl = dl * sl.
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> s;
  std::vector<float> dl, xsl;
  std::vector<int32_t> sl;
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
#if defined(PAGEDJAX_GGUF_VNNI)
  const int64_t np = nb / 2;
  out.dl.resize(M * np * 16);
  out.xsl.resize(M * np * 16);
  out.sl.resize(M * np * 16);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < np; ++c) {
      const int64_t i = m * np + c;
      const __m512i xq = _mm512_loadu_si512(out.q.data() + m * K + c * 64);
      const __m512i sl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, xq);
      const float d0 = out.d[m * nb + 2 * c], d1 = out.d[m * nb + 2 * c + 1];
      const __m512 dl = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
      _mm512_storeu_si512(out.sl.data() + i * 16, sl);
      _mm512_storeu_ps(out.dl.data() + i * 16, dl);
      _mm512_storeu_ps(out.xsl.data() + i * 16, _mm512_mul_ps(dl, _mm512_cvtepi32_ps(sl)));
    }
#endif
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
constexpr int R = 4;   // rows of W per VNNI tile

template <int64_t T>
constexpr int kOffsetShift = T == Q4_0 ? 3 : T == Q5_0 ? 4 : T == Q8_0 ? 7 : 0;  // o = 2^shift

// Block b of one output row with one row of x, in scalar code: d dx (sum u xq - o s) + m dx s.
template <int64_t T>
inline float ScalarBlock(const uint8_t* row, const float* ds, const float* ms, const QuantX& X,
                         int64_t K, int64_t nb, int64_t m, int64_t b) {
  const int64_t xm = m * nb + b;
  float v = BlockDot<T>(row + b * kBlockBytes<T>, ds[b], X.q.data() + m * K + b * 32, X.d[xm],
                        X.s[xm]);
  if constexpr (kHasMin<T>) v += ms[b] * X.ds[xm];
  return v;
}

#if defined(PAGEDJAX_GGUF_VNNI)
// Two adjacent floats p[0], p[1] -> lanes 0-7 p[0], lanes 8-15 p[1].
inline __m512 PairLanes(const float* p) {
  return _mm512_insertf32x8(_mm512_set1_ps(p[0]), _mm256_set1_ps(p[1]), 1);
}

// RR rows of W (n, ..., n + RR - 1) times MM rows of x (m0, ...): per pair of blocks, the 64
// unsigned weight bytes of each row times the 64 int8 activations of each x row (vpdpbusd:
// lane j sums 4 products), the offset o * (the lane's activation sum) subtracted exactly in
// int32, converted, scaled by d dx per lane and accumulated, the min term m * dx * (the lane's
// activation sum) accumulated in the same lanes; a fixed tree over the lanes at the end and,
// for an odd number of blocks, the last one in scalar code. Each (m, n) takes the same
// operations whatever MM and RR are (batch invariance).
template <int64_t T, int RR, int MM>
void VnniTile(const Problem& p, int64_t n, int64_t m0, const float* sc, int64_t sc_stride) {
  const QuantX& X = *p.xq;
  const int64_t nb = p.K / 32, np = nb / 2;
  constexpr int64_t B = kBlockBytes<T>;
  const uint8_t* w = p.w + n * p.row_bytes;
  __m512 acc[MM][RR];
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < np; ++c) {
    const int64_t b = 2 * c;
    __m512i u[RR];
    __m512 dw[RR], mw[RR];
    for (int r = 0; r < RR; ++r) {
      u[r] = Unsigned64<T>(w + r * p.row_bytes + b * B);
      dw[r] = PairLanes(sc + r * sc_stride + b);
      if constexpr (kHasMin<T>) mw[r] = PairLanes(sc + r * sc_stride + nb + b);
    }
    for (int m = 0; m < MM; ++m) {
      const int64_t xi = ((m0 + m) * np + c) * 16;
      const __m512i xq = _mm512_loadu_si512(X.q.data() + (m0 + m) * p.K + b * 32);
      const __m512 dx = _mm512_loadu_ps(X.dl.data() + xi);
      for (int r = 0; r < RR; ++r) {
        __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[r], xq);
        if constexpr (kOffsetShift<T> != 0)
          isum = _mm512_sub_epi32(
              isum, _mm512_slli_epi32(_mm512_loadu_si512(X.sl.data() + xi), kOffsetShift<T>));
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw[r], dx), acc[m][r]);
        if constexpr (kHasMin<T>)
          acc[m][r] = _mm512_fmadd_ps(mw[r], _mm512_loadu_ps(X.xsl.data() + xi), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < RR; ++r) {
      float y = HSum((vf)acc[m][r]);
      if (nb % 2)
        y += ScalarBlock<T>(w + r * p.row_bytes, sc + r * sc_stride, sc + r * sc_stride + nb, X,
                            p.K, nb, m0 + m, nb - 1);
      p.y[(m0 + m) * p.N + n + r] = y;
    }
}

typedef void (*VnniFn)(const Problem&, int64_t, int64_t, const float*, int64_t);

template <int64_t T, int RR, int... Ms>
constexpr std::array<VnniFn, sizeof...(Ms) + 1> VnniRow(std::integer_sequence<int, Ms...>) {
  return {nullptr, VnniTile<T, RR, Ms + 1>...};
}

// kVnni<T>[rr][mt]: a tile of rr rows of W (1..R) and mt rows of x (1..MT).
template <int64_t T>
const std::array<std::array<VnniFn, MT + 1>, R + 1> kVnni = {
    std::array<VnniFn, MT + 1>{},
    VnniRow<T, 1>(std::make_integer_sequence<int, MT>{}),
    VnniRow<T, 2>(std::make_integer_sequence<int, MT>{}),
    VnniRow<T, 3>(std::make_integer_sequence<int, MT>{}),
    VnniRow<T, 4>(std::make_integer_sequence<int, MT>{}),
};
#endif

// Output rows [n0, n1) (the prefetches run up to pf_end): VNNI tiles of R rows of W where the
// path has them, else each row and each pass of up to MT rows of x in scalar code.
template <int64_t T>
void RunItem(const Problem& p, int64_t n0, int64_t n1, int64_t pf_end, std::vector<float>& scales) {
  const int64_t nb = p.K / 32;
  constexpr int64_t B = kBlockBytes<T>;
  const int64_t stride = 2 * nb + 16;  // a row's d [nb], then its m [nb]
  scales.resize(R * stride);
#if defined(PAGEDJAX_GGUF_VNNI)
  for (int64_t n = n0; n < n1; n += R) {
    const int rr = int(std::min<int64_t>(R, n1 - n));
    // the rows two tiles ahead, as the float32 kernel does (profiles of a one-row decode step
    // of the default model, two runs: its fused gate/up call 167 us without, 123 us with)
    Prefetch(p.w + (n + 2 * R) * p.row_bytes,
             std::min<int64_t>(pf_end - n - 2 * R, R) * p.row_bytes);
    for (int r = 0; r < rr; ++r)
      BlockHalves<B>(p.w + (n + r) * p.row_bytes, nb, &scales[r * stride],
                     kHasMin<T> ? &scales[r * stride + nb] : nullptr);
    for (int64_t m0 = 0; m0 < p.M; m0 += MT) {
      const int mt = int(std::min<int64_t>(MT, p.M - m0));
      kVnni<T>[rr][mt](p, n, m0, scales.data(), stride);
    }
  }
#else
  float* ds = scales.data();
  float* ms = scales.data() + nb;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    BlockHalves<B>(row, nb, ds, kHasMin<T> ? ms : nullptr);
    for (int64_t m = 0; m < p.M; ++m) {
      float y = 0.0f;
      for (int64_t b = 0; b < nb; ++b) y += ScalarBlock<T>(row, ds, ms, *p.xq, p.K, nb, m, b);
      p.y[m * p.N + n] = y;
    }
  }
#endif
}

typedef void (*ItemFn)(const Problem&, int64_t, int64_t, int64_t, std::vector<float>&);

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
  // One contiguous range of rows per thread, as the float32 kernel (gguf_linear_cpu.cc).
  pagedjax::ParallelRanges(pool, items, [&p, run](int64_t i, int64_t end) {
    thread_local std::vector<float> scales;
    const int64_t n0 = i * p.item_rows;
    run(p, n0, std::min(p.N, n0 + p.item_rows), std::min(p.N, end * p.item_rows), scales);
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
