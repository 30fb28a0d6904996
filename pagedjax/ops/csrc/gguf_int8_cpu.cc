// y = x @ W[layer] for a GGUF weight of a 32-value block format (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0) with the activations quantized to int8: integer dot products per block, as an XLA FFI
// custom call (the engine's gguf_activations="int8"; pagedjax/ops/cpu_gguf.py).
//
// Activations (after llama.cpp's Q8_0 activations, quantize_row_q8_0 in ggml-quants.c): each
// row of x is cut into 32-value blocks; block b gets the scale dx_b = max|x| / 127 (0 for an
// all-zero block) and the integers xq = round(x / dx_b) (ties away from zero), |xq| <= 127,
// with their sum s_b. Done once per call, before the products are spread (over the pool, row by
// row, from 8 rows up).
//
// Weights: block b of an output row holds 32 unsigned integers u (a nibble, a nibble with its
// fifth bit, or, for Q8_0, the signed byte + 128) with w = d (u - o) + m, o the format's offset
// (8 for Q4_0, 16 for Q5_0, 128 for Q8_0, else 0) and m its min (Q4_1, Q5_1; else 0). So
//     sum_k w_k x_k ~= sum_b dx_b [d_b (sum_j u_j xq_j - o s_b) + m_b s_b],
// the integer sum exact in int32 (|u xq| <= 255 * 127, 32 terms), the rest in float32.
//
// On AVX-512 with VNNI, each block's integer sum is exact (less the offset) and is scaled and
// accumulated in float32 in one fixed order: even blocks into acc_0, odd ones into acc_1,
// y = acc_0 + acc_1. Two paths give every (m, n) exactly those operations, so that a row's
// result does not depend on M, on which path runs, or on the thread count (batch invariance):
// - up to 8 rows of x (`VnniGroup`): one block of a group of 4 output rows at a time, the 4
//   rows' weight bytes in one register (nibble formats, a 128-bit lane per row) or two (Q8_0, a
//   256-bit half per row), the x block broadcast to match, vpdpbusd into int32 lanes, a row's
//   lanes summed in place, the 4 rows' scales converted together and spread over their lanes.
//   Single thread, Zen 4 EPYC, a 576 x 3072 Q4_1 layer at M = 1: 62-75 us;
// - from 9 rows (`PanelItem`, csrc/gguf_int8_panels.h): the weights repacked in panels of 16
//   output rows, an int32 lane per row, 64 products per vpdpbusd; the same layer at M = 37
//   ~500 us (~130 GMAC/s, against ~55 for the groups).
// Elsewhere the same sums block by block in scalar code (one float32 accumulator).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_int8_panels.h"
#include "parallel.h"
#include "simd.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace pagedjax_gguf;
using namespace pagedjax_gguf_int8;

// Blocks [i0, i1) of x (32 values each, rows one after another) -> out's q, d, s and ds; out
// already sized (`SizeFor`). On AVX-512 in vector code with the same
// values as the scalar code: the same max, division and product, and round half away from
// zero done exactly (floor(|v|), plus one where |v| - floor(|v|) >= 1/2, which is exact).
void QuantizeBlocks(const float* x, int64_t i0, int64_t i1, QuantX& out) {
  for (int64_t i = i0; i < i1; ++i) {
    const float* xb = x + i * 32;
    int8_t* q = out.q.data() + i * 32;
#if defined(PAGEDJAX_ISA_AVX512)
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    auto quantize = [inv](__m512 v) {
      const __m512 scaled = _mm512_mul_ps(v, _mm512_set1_ps(inv));
      const __m512 a = _mm512_abs_ps(scaled);
      const __m512 t = _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      const __mmask16 up =
          _mm512_cmp_ps_mask(_mm512_sub_ps(a, t), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
      const __m512 r = _mm512_min_ps(_mm512_mask_add_ps(t, up, t, _mm512_set1_ps(1.0f)),
                                     _mm512_set1_ps(127.0f));
      const __m512i u = _mm512_cvttps_epi32(r);
      const __mmask16 neg = _mm512_cmp_ps_mask(scaled, _mm512_setzero_ps(), _CMP_LT_OQ);
      return _mm512_mask_sub_epi32(u, neg, _mm512_setzero_si512(), u);
    };
    const __m512i q0 = quantize(v0), q1 = quantize(v1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      q[j] = int8_t(std::clamp(int(std::round(xb[j] * inv)), -127, 127));
      sum += q[j];
    }
#endif
    out.d[i] = d;
    out.s[i] = sum;
    out.ds[i] = d * float(sum);
  }
}

void SizeFor(int64_t M, int64_t K, QuantX& out) {
  const int64_t nb = K / 32;
  out.q.resize(M * K);
  out.d.resize(M * nb);
  out.ds.resize(M * nb);
  out.s.resize(M * nb);
}

void QuantizeRows(const float* x, int64_t M, int64_t K, QuantX& out) {
  SizeFor(M, K, out);
  QuantizeBlocks(x, 0, M * (K / 32), out);
}

template <int64_t T>
constexpr int32_t kOffset = kOffsetShift<T> != 0 ? 1 << kOffsetShift<T> : 0;  // o

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

constexpr int MT = 8;  // rows of x per pass over a group (8 against 4: -12 % at M = 16 and 64)
constexpr int R = 4;   // rows of W per VNNI group

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
// A group of 4 output rows (rows[0..3]; a short group repeats its last row) times MM rows of x
// (m0, ...). Each (m, n) gets exactly the operations of the panel path (`PanelTile`): per
// block b, the integer sum less the offset, isum_b = sum_j u_j xq_j - o s_b, exact; then
// acc_{b mod 2} += float(isum_b) (d_b dx_b) and, with a min, acc_{b mod 2} += m_b (dx_b s_b);
// y = acc_0 + acc_1. The weight bytes of the 4 rows in 512-bit registers:
// - nibble formats (`NibbleGroup`), two blocks at a time: per block one register, 128-bit lane
//   r holding row r's 16 nibble bytes, the low nibbles (values 0-15) and the high ones (16-31)
//   masked out in place (`FourRows`); the x block's values 0-15 and 16-31 broadcast to the 4
//   lanes, two vpdpbusd give int32 lane 4r + j row r's sum over values 4j..4j+3 and
//   16+4j..16+4j+3 (-o s starting lane 0). The two blocks' sums are folded together, block b's
//   total into lanes 4r and 4r+1, block b+1's into 4r+2 and 4r+3 (two unpacks, a shuffle, two
//   adds), and scaled and accumulated in one go: lanes 4r hold acc_0, 4r+2 acc_1.
// - Q8_0 (`Q8Group`): two registers of two rows (256-bit halves) of bytes + 128 (unsigned), the
//   x block broadcast to both halves, one vpdpbusd each; a row's 8 lanes summed in place
//   (three shuffles), accumulated into lanes 0-3 of a half for even blocks, 4-7 for odd ones.
// The rows' f16 words at a block's start (d and m) are loaded together, converted and spread
// by vpermps. (The scales are converted here, block by block: converting each row's scales
// first with a gather took about half of this kernel's time on a Zen 4 EPYC, whose gathers are
// slow; a row's 32-value blocks unpacked in pairs, as before, took twice the time.) Each (m, n)
// takes the same operations whatever MM, the group and the thread count are, and whichever of
// this path and the panel path runs (batch invariance).
template <int64_t T, int MM>
void NibbleGroup(const Problem& p, const uint8_t* const* rows, int64_t m0, int rr, int64_t n) {
  const QuantX& X = *p.xq;
  const int64_t nb = p.K / 32;
  constexpr int64_t B = kBlockBytes<T>;
  // lane -> its row's d (and m) in the converted [d0 m0 .. d3 m3 | block b + 1's]
  const __m512i d_idx = _mm512_setr_epi32(0, 0, 8, 8, 2, 2, 10, 10, 4, 4, 12, 12, 6, 6, 14, 14);
  const __m512i m_idx = _mm512_setr_epi32(1, 1, 9, 9, 3, 3, 11, 11, 5, 5, 13, 13, 7, 7, 15, 15);
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;  // else block b + 1 is zeros (scales 0)
    const int64_t o = b * B;
    __m512i lo0, hi0, lo1 = zero, hi1 = zero;
    FourRows<T>(rows, o, lo0, hi0);
    if (two) FourRows<T>(rows, o + B, lo1, hi1);
    uint32_t h[8];  // d and the next f16 word (m); built in registers (a vector load of
    // words just stored stalls on store forwarding)
    for (int r = 0; r < 4; ++r) {
      std::memcpy(&h[r], rows[r] + o, 4);
      h[4 + r] = 0;
      if (two) std::memcpy(&h[4 + r], rows[r] + o + B, 4);
    }
    const __m512 dm = _mm512_cvtph_ps(_mm256_setr_epi32(int(h[0]), int(h[1]), int(h[2]),
                                                        int(h[3]), int(h[4]), int(h[5]),
                                                        int(h[6]), int(h[7])));
    const __m512 dv = _mm512_permutexvar_ps(d_idx, dm);
    const __m512 mv = kHasMin<T> ? _mm512_permutexvar_ps(m_idx, dm) : _mm512_setzero_ps();
    for (int m = 0; m < MM; ++m) {
      const int64_t xi = (m0 + m) * nb + b;
      const int8_t* xb = X.q.data() + xi * 32;
      auto bcast = [](const int8_t* v) {
        return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
      };
      auto init = [&](int64_t i) {  // -o s in the first lane of each row
        return kOffsetShift<T> != 0 ? _mm512_maskz_set1_epi32(0x1111, -(X.s[i] << kOffsetShift<T>))
                                    : zero;
      };
      const __m512i i0 =
          _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init(xi), lo0, bcast(xb)), hi0, bcast(xb + 16));
      __m512i i1 = zero;
      if (two)
        i1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init(xi + 1), lo1, bcast(xb + 32)), hi1,
                                 bcast(xb + 48));
      // lanes 4r, 4r + 1: block b's total; 4r + 2, 4r + 3: block b + 1's
      __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(i0, i1), _mm512_unpackhi_epi64(i0, i1));
      t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
      // [dx_b dx_b dx_b+1 dx_b+1] in every 128-bit lane (0 past the last block); ds likewise
      auto pair = [two](const float* v) {
        uint32_t lo, hi = 0;
        std::memcpy(&lo, v, 4);
        if (two) std::memcpy(&hi, v + 1, 4);
        const int64_t bits = int64_t(uint64_t(lo) | (uint64_t(hi) << 32));
        return _mm512_permute_ps(_mm512_castsi512_ps(_mm512_set1_epi64(bits)), 0x50);
      };
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dv, pair(&X.d[xi])), acc[m]);
      if constexpr (kHasMin<T>) acc[m] = _mm512_fmadd_ps(mv, pair(&X.ds[xi]), acc[m]);
    }
  }
  for (int m = 0; m < MM; ++m) {
    alignas(64) float l[16];
    _mm512_store_ps(l, acc[m]);
    float* y = p.y + (m0 + m) * p.N + n;
    for (int r = 0; r < rr; ++r) y[r] = l[4 * r] + l[4 * r + 2];
  }
}

template <int MM>
void Q8Group(const Problem& p, const uint8_t* const* rows, int64_t m0, int rr, int64_t n) {
  const QuantX& X = *p.xq;
  const int64_t nb = p.K / 32;
  constexpr int64_t B = kBlockBytes<Q8_0>, off = kValues<Q8_0>;
  // lane -> its row's d in the converted [d0 d1 d2 d3]
  const __m512i d_lanes[2] = {
      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
      _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)};
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 acc[MM][2];
  for (int m = 0; m < MM; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * B;
    const __mmask16 half = (b & 1) ? 0xF0F0 : 0x0F0F;  // acc_0 in lanes 0-3 of a row, acc_1 4-7
    auto two = [&](int r) {
      return _mm512_xor_si512(
          _mm512_inserti64x4(
              _mm512_castsi256_si512(
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + o + off))),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r + 1] + o + off)), 1),
          flip);
    };
    const __m512i w[2] = {two(0), two(2)};
    uint16_t h[4];
    for (int r = 0; r < 4; ++r) std::memcpy(&h[r], rows[r] + o, 2);
    const __m512 dq = _mm512_castps256_ps512(
        _mm256_cvtph_ps(_mm_setr_epi16(short(h[0]), short(h[1]), short(h[2]), short(h[3]), 0, 0,
                                       0, 0)));
    const __m512 dv[2] = {_mm512_permutexvar_ps(d_lanes[0], dq),
                          _mm512_permutexvar_ps(d_lanes[1], dq)};
    for (int m = 0; m < MM; ++m) {
      const int64_t xi = (m0 + m) * nb + b;
      const __m512i xv = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.q.data() + xi * 32)));
      const __m512i init = _mm512_maskz_set1_epi32(0x0101, -(X.s[xi] << kOffsetShift<Q8_0>));
      const __m512 dx = _mm512_set1_ps(X.d[xi]);
      for (int g = 0; g < 2; ++g) {
        // every lane of a row (a 256-bit half): the sum of its 8 lanes
        __m512i t = _mm512_dpbusd_epi32(init, w[g], xv);
        t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
        t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
        t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0xB1));
        acc[m][g] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dv[g], dx),
                                          acc[m][g], half);
      }
    }
  }
  for (int m = 0; m < MM; ++m) {
    alignas(64) float l[32];
    _mm512_store_ps(l, acc[m][0]);
    _mm512_store_ps(l + 16, acc[m][1]);
    float* y = p.y + (m0 + m) * p.N + n;
    for (int r = 0; r < rr; ++r) y[r] = l[8 * r] + l[8 * r + 4];
  }
}

template <int64_t T, int MM>
void VnniGroup(const Problem& p, const uint8_t* const* rows, int64_t m0, int rr, int64_t n) {
  if constexpr (T == Q8_0)
    Q8Group<MM>(p, rows, m0, rr, n);
  else
    NibbleGroup<T, MM>(p, rows, m0, rr, n);
}

typedef void (*GroupFn)(const Problem&, const uint8_t* const*, int64_t, int, int64_t);

template <int64_t T, int... Ms>
constexpr std::array<GroupFn, MT + 1> GroupRow(std::integer_sequence<int, Ms...>) {
  return {nullptr, VnniGroup<T, Ms + 1>...};
}
#endif

// Output rows [n0, n1) (the prefetches run up to pf_end): panels from kPanelMinRows rows of x,
// else VNNI groups of R rows of W for up to MT rows of x at a time, where the path has them;
// else row by row in scalar code.
template <int64_t T>
void RunItem(const Problem& p, int64_t n0, int64_t n1, int64_t pf_end, std::vector<float>& scales) {
#if defined(PAGEDJAX_GGUF_VNNI)
  if (p.M >= kPanelMinRows) return PanelItem<T>(p, n0, n1, pf_end);
  static constexpr std::array<GroupFn, MT + 1> kGroups =
      GroupRow<T>(std::make_integer_sequence<int, MT>{});
  for (int64_t n = n0; n < n1; n += R) {
    const int rr = int(std::min<int64_t>(R, n1 - n));
    // the rows two groups ahead (profiles of a one-row decode step of the default model, two
    // runs: its fused gate/up call 167 us without, 123 us with)
    Prefetch(p.w + (n + 2 * R) * p.row_bytes,
             std::min<int64_t>(pf_end - n - 2 * R, R) * p.row_bytes);
    const uint8_t* rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = p.w + (n + std::min(r, rr - 1)) * p.row_bytes;
    for (int64_t m0 = 0; m0 < p.M; m0 += MT)
      kGroups[std::min<int64_t>(MT, p.M - m0)](p, rows, m0, rr, n);
  }
#else
  const int64_t nb = p.K / 32;
  constexpr int64_t B = kBlockBytes<T>;
  scales.resize(2 * nb + 16);
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
  // x quantized before the work is spread: by this thread for a few rows, else row by row over
  // the pool (a 64-row step of the default model spent ~40 % of its time here on one thread)
  if (p.M < 8) {
    QuantizeRows(x.typed_data(), p.M, p.K, xq);
  } else {
    SizeFor(p.M, p.K, xq);
    const int64_t nb = p.K / 32;
    const float* xs = x.typed_data();
    QuantX* out = &xq;  // this thread's (a worker naming `xq` would get its own)
    pagedjax::ParallelFor(pool, p.M, [xs, nb, out](int64_t m) {
      QuantizeBlocks(xs, m * nb, (m + 1) * nb, *out);
    });
  }
  p.xq = &xq;
  const int64_t threads = pagedjax::Threads(pool);
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
