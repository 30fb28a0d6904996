// The int8-activation GGUF kernel (csrc/gguf_int8_cpu.cc): its types, and its path for steps
// of kPanelMinRows rows of x or more on AVX-512 with VNNI (prefill, large decode batches),
// which gives every (m, n) the same bits as the small-step path (`VnniGroup`).
//
// The small-step path holds 4 output rows in one register (a 128-bit lane per row) and
// broadcasts 16 bytes of x to the 4 lanes for each row of x: per 4 output rows and 32 values,
// two vector broadcasts, two vpdpbusd and an in-lane sum. For many rows of x it pays to lay the
// weights out once so that each int32 lane is one output row instead: a panel of 16 output
// rows is repacked, block by block, into 8 registers, register c holding the 4 bytes of values
// 4c..4c+3 of each of the 16 rows (the format's unsigned integers u, as the small path uses
// them), with the 16 rows' d and m converted to float. Then one vpdpbusd with a 4-byte
// broadcast of x does 64 products for 16 output rows, 8 of them give the block's exact integer
// sums, and the scaling (d dx, the offset and the min) is done once per 16 rows.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pagedjax_gguf_int8 {

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

struct Problem {
  const QuantX* xq;
  const uint8_t* w;  // this layer's rows [N][row_bytes]
  float* y;          // [M, N]
  int64_t M, K, N, row_bytes;
  int64_t item_rows;
};

// The formats' offset o = 2^shift (w = d (u - o) + m): Q4_0 8, Q5_0 16, Q8_0 128, else none.
template <int64_t T>
constexpr int kOffsetShift = T == Q4_0 ? 3 : T == Q5_0 ? 4 : T == Q8_0 ? 7 : 0;

#if defined(PAGEDJAX_GGUF_VNNI)
// Where a block's quantized values start (after d, m and qh).
template <int64_t T>
constexpr int64_t kValues = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : T == Q5_1 ? 8 : 2;

constexpr int kPanel = 16;  // output rows per panel: one int32 lane each
// From this many rows of x up the panels are used. Single thread, Zen 4 EPYC, a 576 x 3072
// Q4_1 layer: M = 8 286-296 us against 301-314 for the small path, M = 12 294-410 against
// 447-520 (which takes 8 rows of x per pass); M = 37 ~500 us (130 GMAC/s).
constexpr int64_t kPanelMinRows = 9;
// A repacked block of a panel: 8 registers of [16 rows][4 bytes], then d [16] and m [16].
constexpr int64_t kPanelBlockVecs = 10;
constexpr int64_t kChunkRows = 128;  // rows of x per pass over an item's panels (x in L2)

// The 32-value blocks of 4 rows (rows[0..3]) as two registers, a 128-bit lane per row: lo
// their unsigned integers u of values 0-15, hi of values 16-31.
template <int64_t T>
inline void FourRows(const uint8_t* const* rows, int64_t o, __m512i& lo, __m512i& hi) {
  constexpr int64_t off = kValues<T>;
  auto lanes = [&](int64_t at) {
    __m512i q = _mm512_castsi128_si512(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[0] + at)));
    for (int r = 1; r < 4; ++r)
      q = _mm512_inserti32x4(q, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + at)),
                             r);
    return q;
  };
  if constexpr (T == Q8_0) {
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    lo = _mm512_xor_si512(lanes(o + off), flip);
    hi = _mm512_xor_si512(lanes(o + off + 16), flip);
  } else {
    const __m512i q = lanes(o + off);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(q, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
    if constexpr (T == Q5_0 || T == Q5_1) {
      uint64_t klo = 0, khi = 0;
      for (int r = 0; r < 4; ++r) {
        uint32_t qh;
        std::memcpy(&qh, rows[r] + o + off - 4, 4);
        klo |= uint64_t(qh & 0xFFFFu) << (16 * r);
        khi |= uint64_t(qh >> 16) << (16 * r);
      }
      const __m512i sixteen = _mm512_set1_epi8(16);
      lo = _mm512_mask_add_epi8(lo, __mmask64(klo), lo, sixteen);
      hi = _mm512_mask_add_epi8(hi, __mmask64(khi), hi, sixteen);
    }
  }
}

// 4 registers of 4 rows each (a[k]: rows 4k..4k+3, a 128-bit lane per row, dword j of a lane
// = class j) -> 4 registers of the 16 rows (out[j]: dword r = row r's dword j).
inline void Transpose16x4(const __m512i* a, __m512i* out) {
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i c[4];  // c[k]: lane j = dword j of rows 4k..4k+3
  for (int k = 0; k < 4; ++k) c[k] = _mm512_permutexvar_epi32(idx, a[k]);
  const __m512i t01lo = _mm512_shuffle_i32x4(c[0], c[1], 0x44);  // c0.0 c0.1 c1.0 c1.1
  const __m512i t01hi = _mm512_shuffle_i32x4(c[0], c[1], 0xEE);  // c0.2 c0.3 c1.2 c1.3
  const __m512i t23lo = _mm512_shuffle_i32x4(c[2], c[3], 0x44);
  const __m512i t23hi = _mm512_shuffle_i32x4(c[2], c[3], 0xEE);
  out[0] = _mm512_shuffle_i32x4(t01lo, t23lo, 0x88);  // c0.0 c1.0 c2.0 c3.0
  out[1] = _mm512_shuffle_i32x4(t01lo, t23lo, 0xDD);  // c0.1 c1.1 c2.1 c3.1
  out[2] = _mm512_shuffle_i32x4(t01hi, t23hi, 0x88);
  out[3] = _mm512_shuffle_i32x4(t01hi, t23hi, 0xDD);
}

// Output rows [n, n + rr) (rr <= 16; a short panel repeats its last row) -> a panel of nb
// repacked blocks at out (kPanelBlockVecs registers each).
template <int64_t T>
void RepackPanel(const Problem& p, int64_t n, int rr, int64_t pf_rows, __m512i* out) {
  const int64_t nb = p.K / 32;
  constexpr int64_t B = kBlockBytes<T>;
  const uint8_t* rows[kPanel];
  for (int r = 0; r < kPanel; ++r) rows[r] = p.w + (n + std::min(r, rr - 1)) * p.row_bytes;
  const uint8_t* next = p.w + (n + kPanel) * p.row_bytes;  // the next panel, pf_rows of its rows
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * B;
    // the next panel's block b, while this one is repacked (the rows are 16 interleaved streams:
    // the Q8_0 LM head's repack read 4.9 GB/s from memory without)
    for (int64_t r = 0; r < pf_rows; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(next + r * p.row_bytes + o), _MM_HINT_T0);
    __m512i lo[4], hi[4];
    for (int k = 0; k < 4; ++k) FourRows<T>(rows + 4 * k, o, lo[k], hi[k]);
    __m512i* v = out + b * kPanelBlockVecs;
    Transpose16x4(lo, v);      // classes 0-3: values 4c..4c+3
    Transpose16x4(hi, v + 4);  // classes 4-7: values 16 + 4(c - 4)..
    alignas(64) uint32_t h[kPanel];  // d and the next f16 word (m for Q4_1 / Q5_1)
    for (int r = 0; r < kPanel; ++r) std::memcpy(&h[r], rows[r] + o, 4);
    const __m512i dm = _mm512_load_si512(h);
    v[8] = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
    v[9] = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
  }
}

typedef int32_t Word __attribute__((may_alias));

// Block b of a repacked panel times rows m0..m0+MM of x, into acc: per row, the exact integer
// sum of the 32 products (8 vpdpbusd in two chains, the first starting from -o s: the sum less
// the offset), then acc += float(isum) (d dx) and, with a min, acc += m (dx s).
template <int64_t T, int MM>
inline __attribute__((always_inline)) void PanelBlock(const QuantX& X, const __m512i* v,
                                                      int64_t nb, int64_t m0, int64_t b,
                                                      __m512* acc) {
  __m512i wv[8];
  for (int c = 0; c < 8; ++c) wv[c] = _mm512_load_si512(v + c);
  const __m512 dv = _mm512_castsi512_ps(_mm512_load_si512(v + 8));
  for (int m = 0; m < MM; ++m) {
    const int64_t xi = (m0 + m) * nb + b;
    // the block's 32 int8 values as 8 words, each broadcast to the 16 lanes
    const Word* xw = reinterpret_cast<const Word*>(X.q.data() + xi * 32);
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    if constexpr (kOffsetShift<T> != 0) s0 = _mm512_set1_epi32(-(X.s[xi] << kOffsetShift<T>));
    for (int c = 0; c < 8; c += 2) {
      s0 = _mm512_dpbusd_epi32(s0, wv[c], _mm512_set1_epi32(xw[c]));
      s1 = _mm512_dpbusd_epi32(s1, wv[c + 1], _mm512_set1_epi32(xw[c + 1]));
    }
    const __m512i isum = _mm512_add_epi32(s0, s1);
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dv, _mm512_set1_ps(X.d[xi])),
                             acc[m]);
    if constexpr (kHasMin<T>)
      acc[m] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_load_si512(v + 9)),
                               _mm512_set1_ps(X.ds[xi]), acc[m]);
  }
}

// Rows m0..m0+MM of x times a repacked panel (output rows n..n+rr): even blocks accumulated
// into acc_0, odd ones into acc_1, y = acc_0 + acc_1, as the small path does.
template <int64_t T, int MM>
void PanelTile(const Problem& p, const __m512i* panel, int64_t m0, int rr, int64_t n) {
  const QuantX& X = *p.xq;
  const int64_t nb = p.K / 32;
  __m512 acc[2][MM];
  for (int m = 0; m < MM; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    PanelBlock<T, MM>(X, panel + b * kPanelBlockVecs, nb, m0, b, acc[0]);
    PanelBlock<T, MM>(X, panel + (b + 1) * kPanelBlockVecs, nb, m0, b + 1, acc[1]);
  }
  if (b < nb) PanelBlock<T, MM>(X, panel + b * kPanelBlockVecs, nb, m0, b, acc[0]);
  const __mmask16 keep = __mmask16((1u << rr) - 1);
  for (int m = 0; m < MM; ++m)
    _mm512_mask_storeu_ps(p.y + (m0 + m) * p.N + n, keep, _mm512_add_ps(acc[0][m], acc[1][m]));
}

// Output rows [n0, n1) for all M rows of x (the prefetches run up to pf_end): the rows
// repacked in panels of 16 (once per call), then chunks of kChunkRows rows of x over the
// panels, 4 rows of x per tile (8 accumulators, 8 weight registers).
template <int64_t T>
void PanelItem(const Problem& p, int64_t n0, int64_t n1, int64_t pf_end) {
  constexpr int MM = 4;
  const int64_t nb = p.K / 32;
  const int64_t panels = (n1 - n0 + kPanel - 1) / kPanel;
  struct alignas(64) Vec {  // (a vector of __m512i drops the type's attributes)
    uint8_t bytes[64];
  };
  thread_local std::vector<Vec> storage;  // 64-byte aligned (C++17 aligned new)
  storage.resize(panels * nb * kPanelBlockVecs);
  __m512i* const packed = reinterpret_cast<__m512i*>(storage.data());
  for (int64_t i = 0; i < panels; ++i) {
    const int64_t n = n0 + i * kPanel;
    RepackPanel<T>(p, n, int(std::min<int64_t>(kPanel, n1 - n)),
                   std::clamp<int64_t>(pf_end - n - kPanel, 0, kPanel),
                   packed + i * nb * kPanelBlockVecs);
  }
  for (int64_t mc = 0; mc < p.M; mc += kChunkRows) {
    const int64_t me = std::min(p.M, mc + kChunkRows);
    for (int64_t i = 0; i < panels; ++i) {
      const int64_t n = n0 + i * kPanel;
      const int rr = int(std::min<int64_t>(kPanel, n1 - n));
      const __m512i* panel = packed + i * nb * kPanelBlockVecs;
      int64_t m0 = mc;
      for (; m0 + MM <= me; m0 += MM) PanelTile<T, MM>(p, panel, m0, rr, n);
      for (; m0 < me; ++m0) PanelTile<T, 1>(p, panel, m0, rr, n);
    }
  }
}
#endif

}  // namespace pagedjax_gguf_int8
