// y = x @ W[layer] for a weight kept in a GGUF block format, on CPU, as an XLA FFI custom call.
//
// W is a stacked GGUF weight, uint8 [L][N][row_bytes]: row n holds the K inputs of output n
// in blocks, as llama.cpp stores a tensor (formats and their layouts: pagedjax/ops/gguf_quant.py,
// after ggml's ggml-common.h). x is float32 [M, K], y float32 [M, N]; the float32 weights
// are never materialised: a work item (a range of output rows) dequantizes a few rows of W
// at a time into a small float buffer (in L1 / L2) and multiplies them with every row of x
// before it moves on, so a step reads each weight block once, whatever M. Accumulation is
// in float32.
//
// Dequantization is vector code per format: the packed bytes widened to int32 lanes
// (vpmovzxbd / vpmovsxbd on x86: GCC's __builtin_convertvector widens lane by lane), nibbles
// and high bits masked and shifted in the lanes, converted and scaled (F16C for the f16
// scales where the path has it); on AVX-512 the nibble formats look their values up in a
// per-block table of the 16 (or 32) possible values instead (`Nibbles32`).
//
// Products: dot products over K for every row count. A tile of MT rows of x (4 on AVX-512,
// 2 elsewhere) times a few rows of W keeps one vector accumulator per pair; lane j of
// acc[m][r] sums x[m, k] w[r, k] over k = j, j + V, j + 2V, ... in order (V the vector width),
// and a fixed tree over the lanes (`HSum`) gives y[m, n]. RB rows (6 on AVX-512, 4 elsewhere)
// are dequantized into a buffer [RB][K] (L1) that every tile of x reads, or, in steps of at
// most MT rows and formats of 32-value blocks, R = 4 rows straight into registers block by
// block (`FusedTile`: no buffer, the same values and order), the R rows' f16 scales of a block
// converted together (`GroupHalves`; the row buffer's rows, block by block, `Half`).
// Every (m, n) is reduced in the same order whatever M is: a row's result does not depend on
// what else is in its step (batch invariance), nor on the thread count. Vector width comes
// from simd.h (AVX-512, AVX2 or the portable 4-float path, one build each).
//
// Only the first `rows` rows of x are multiplied (a step padded to its shape bucket passes its
// number of real tokens); the others are written as zeros. Work items are spread over XLA's
// intra-op thread pool in one contiguous range of rows per thread (`ParallelRanges`: a
// decode step of the default Q4_1 model, one sequence, in one process in alternating blocks
// of 20 steps against interleaved items: 0.83-0.88 ms faster per step, median of 20 and 30
// rounds, faster in 16 and 22 of them). A second handler, GgufDequantize, writes one layer's
// float32 values (the steps too large for this kernel multiply them with XLA's dot). Built by
// pagedjax/ops/cpu_kernels.py.

#include <algorithm>
#include <array>
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

inline vi WidenU8(const uint8_t* p) { return WidenBytes(p); }
inline vi WidenS8(const uint8_t* p) { return WidenSignedBytes(p); }

inline vi Iota() {
  vi v;
  for (int i = 0; i < kVecFloats; ++i) v[i] = i;
  return v;
}

constexpr int kBlockVecs = 32 / kVecFloats;  // vectors per 32-value block

// A 32-value block's 16 nibble bytes -> w[0 : kBlockVecs] = d * q + m, in registers (value j
// from the low half of byte j, value j + 16 from its high half); with qh, bit j of qh is
// value j's fifth bit.
//
// On AVX-512 the block's 16 (or 32) possible values fma(d, q, m) are computed once as a table
// in a register (two with the fifth bit) and each value is looked up by vpermps, which reads
// the low 4 bits of each lane: the widened bytes index the low nibbles as they are and, shifted
// by 4, the high ones; a fifth bit picks the second table through a lane mask. The values are
// the same bits as the lane-wise conversion and fma below (one rounding of d q + m each); per
// 32 values, 4 vector operations and the table's one fma against 7. (A 576 x 3072 Q4_1 layer
// at M = 1, one thread, 30 layers in turn, alternating runs: 176-183 against 143-162 us in the
// quietest rounds; 5-20 % in the others, nothing measurable at M = 8 nor in a whole decode
// step, whose kernels also wait on memory.)
template <bool kFifth>
inline void Nibbles32(const uint8_t* qs, uint32_t qh, float d, float m, vf* w) {
#if defined(PAGEDJAX_ISA_AVX512)
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  const __m512 table = _mm512_fmadd_ps(dv, iota, mv);
  const __m512i q = (__m512i)WidenU8(qs), qhi = _mm512_srli_epi32(q, 4);
  __m512 lo = _mm512_permutexvar_ps(q, table), hi = _mm512_permutexvar_ps(qhi, table);
  if constexpr (kFifth) {
    const __m512 table16 = _mm512_fmadd_ps(dv, _mm512_add_ps(iota, _mm512_set1_ps(16.0f)), mv);
    lo = _mm512_mask_permutexvar_ps(lo, __mmask16(qh), q, table16);
    hi = _mm512_mask_permutexvar_ps(hi, __mmask16(qh >> 16), qhi, table16);
  }
  w[0] = (vf)lo;
  w[1] = (vf)hi;
#else
  const vf dv = Splat(d), mv = Splat(m);
  for (int c = 0; c < 16; c += kVecFloats) {
    const vi q = WidenU8(qs + c);
    vi lo = q & 0xF, hi = q >> 4;
    if constexpr (kFifth) {
      const vi j = Iota() + c;
      const vi h = vi{} + int32_t(qh);
      lo |= ((h >> j) & 1) << 4;
      hi |= ((h >> (j + 16)) & 1) << 4;
    }
    w[c / kVecFloats] = dv * __builtin_convertvector(lo, vf) + mv;
    w[(16 + c) / kVecFloats] = dv * __builtin_convertvector(hi, vf) + mv;
  }
#endif
}

// One 32-value block b of format T (its scale d and min m already converted) -> w[0 :
// kBlockVecs], in registers. The one dequantization of these formats: the row buffer and the
// fused small-M kernel both use it, so they see the same values.
template <int64_t T>
inline void Block32(const uint8_t* b, float d, float m, vf* w) {
  if constexpr (T == Q8_0) {
    const vf dv = Splat(d);
    for (int c = 0; c < 32; c += kVecFloats)
      w[c / kVecFloats] = dv * __builtin_convertvector(WidenS8(b + 2 + c), vf);
  } else if constexpr (T == Q4_0 || T == Q4_1) {
    Nibbles32<false>(b + (T == Q4_0 ? 2 : 4), 0, d, T == Q4_1 ? m : -8.0f * d, w);
  } else {
    const uint8_t* hb = b + (T == Q5_0 ? 2 : 4);
    const uint32_t qh = uint32_t(hb[0]) | (uint32_t(hb[1]) << 8) | (uint32_t(hb[2]) << 16) |
                        (uint32_t(hb[3]) << 24);
    Nibbles32<true>(hb + 4, qh, d, T == Q5_1 ? m : -16.0f * d, w);
  }
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

// One row of K values -> out[0:K]. The inner loops have fixed trip counts and no branches, so
// the compiler vectorizes them.
template <int64_t T>
void DequantRow(const uint8_t* __restrict b, int64_t K, float* __restrict out) {
  const int64_t nb = K / 32;
  if constexpr (T == Q8_0 || T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1) {
    // each block's d and m converted where they are used, the same values as a gather of the
    // row's scales first (single thread, Zen 4 EPYC, 576 x 3072 Q4_1: M = 8 344-367 against
    // 410-422 us, M = 16 592-663 against 657-711 us)
    for (int64_t i = 0; i < nb; ++i, b += kBlockBytes<T>, out += 32) {
      vf w[kBlockVecs];
      Block32<T>(b, Half(b), kHasMin<T> ? Half(b + 2) : 0.0f, w);
      for (int v = 0; v < kBlockVecs; ++v) VStore(out + v * kVecFloats, w[v]);
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
        for (int c = 0; c < 32; c += kVecFloats) {
          const vi v = WidenU8(q + c);
          vi lo = v & 0xF, hi = v >> 4;
          if constexpr (T == Q5_K) {
            const vi h = WidenU8(qh + c);
            lo |= ((h >> (2 * j)) & 1) << 4;
            hi |= ((h >> (2 * j + 1)) & 1) << 4;
          }
          VStore(o + c, Splat(d0) * __builtin_convertvector(lo, vf) - Splat(m0));
          VStore(o + 32 + c, Splat(d1) * __builtin_convertvector(hi, vf) - Splat(m1));
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
        for (int c = 0; c < 32; c += kVecFloats) {  // a chunk lies in one group of 16
          const int is = c / 16;
          const vi lo = WidenU8(ql + c), hi = WidenU8(ql + 32 + c), top = WidenU8(qh + c);
          const vi q1 = ((lo & 0xF) | ((top & 3) << 4)) - 32;
          const vi q2 = ((hi & 0xF) | (((top >> 2) & 3) << 4)) - 32;
          const vi q3 = ((lo >> 4) | (((top >> 4) & 3) << 4)) - 32;
          const vi q4 = ((hi >> 4) | (((top >> 6) & 3) << 4)) - 32;
          VStore(o + c, Splat(d * float(s[is])) * __builtin_convertvector(q1, vf));
          VStore(o + 32 + c, Splat(d * float(s[is + 2])) * __builtin_convertvector(q2, vf));
          VStore(o + 64 + c, Splat(d * float(s[is + 4])) * __builtin_convertvector(q3, vf));
          VStore(o + 96 + c, Splat(d * float(s[is + 6])) * __builtin_convertvector(q4, vf));
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

// The product of every row count: dot products. RB rows of W are dequantized into a buffer
// [RB][K]; a tile of MT rows of x times those RB rows keeps MT x RB vector accumulators, lane j
// of acc[m][r] summing x[m, k] w[r, k] over k = j, j + V, j + 2V, ... (V = kVecFloats) in
// order, and a tree sum of the lanes gives y[m, n + r]. Each (m, n) is reduced in the same
// order whatever M is and however the rows are tiled, so a row's result does not depend on
// the other rows of its step (batch invariance) nor on the thread count.
constexpr int R = 4;                                // rows of W per fused tile (small M)
constexpr int MT = kVecRegs >= 32 ? 4 : 2;          // rows of x per tile
// Rows of W per buffer: on AVX-512, 6 (4 x 6 accumulators, 6 weight vectors and one of x in
// the 32 registers: each x vector, streamed from L2 for M of 8 and more, is used 6 times
// instead of 4). Single thread, M = 64, alternating runs of the quietest rounds, against 4:
// 2,600 against 3,125 us for a 576 x 3072 Q4_1 layer, 1,563 against 1,645 for 1536 x 576,
// 926-989 against 953-1,180 for 576 x 960; a float32-activation decode step of the default
// Q4_1 model with 64 sequences, both in one process in alternating blocks of steps: 211
// against 219 ms (median of 10 rounds; 6 rows faster in 8 of them). Elsewhere 4 (16 registers).
constexpr int RB = kVecRegs >= 32 ? 6 : 4;

template <int M, int RR>
void DotTile(const float* __restrict x, int64_t K, const float* __restrict w,
             float* __restrict y, int64_t N) {
  vf acc[M][RR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = vf{};
  for (int64_t k = 0; k < K; k += kVecFloats) {
    vf wv[RR];
    for (int r = 0; r < RR; ++r) wv[r] = VLoad(w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const vf xv = VLoad(x + m * K + k);
      for (int r = 0; r < RR; ++r) acc[m][r] += xv * wv[r];
    }
  }
  float sums[M * RR];
  HSumMany(&acc[0][0], M * RR, sums);
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) y[m * N + r] = sums[m * RR + r];
}

typedef void (*TileFn)(const float*, int64_t, const float*, float*, int64_t);

template <int RR, int... Ms>
constexpr std::array<TileFn, sizeof...(Ms) + 1> TileRow(std::integer_sequence<int, Ms...>) {
  return {nullptr, DotTile<Ms + 1, RR>...};
}
template <int... Rs>
constexpr std::array<std::array<TileFn, MT + 1>, RB + 1> TileTable(
    std::integer_sequence<int, Rs...>) {
  return {std::array<TileFn, MT + 1>{}, TileRow<Rs + 1>(std::make_integer_sequence<int, MT>{})...};
}
// kTile[rr][mt]: a tile of mt rows of x (1..MT) and rr rows of W (1..RB).
const std::array<std::array<TileFn, MT + 1>, RB + 1> kTile =
    TileTable(std::make_integer_sequence<int, RB>{});

// Small M (at most MT rows of x), formats of 32-value blocks: the R rows' blocks dequantized
// straight into registers and multiplied at once, without the row buffer. The same values
// (Block32) and, per (m, n), the same order of accumulation as DotTile over the buffer, so the
// result is the same bits as for any other M. (Single thread, Zen 4 EPYC, a 576 x 3072 Q4_1
// layer at M = 1: 116-118 us with the scales converted here against 139-149 us with each row's
// converted first by a gather, the same bits.)
template <int64_t T, int M, int RR>
void FusedTile(const float* __restrict x, int64_t K, const uint8_t* __restrict w,
               int64_t row_bytes, float* __restrict y, int64_t N) {
  const int64_t nb = K / 32;
  vf acc[M][RR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = vf{};
  for (int64_t i = 0; i < nb; ++i) {
    alignas(32) float dm[8];
    GroupHalves<RR>(w + i * kBlockBytes<T>, row_bytes, dm);
    for (int r = 0; r < RR; ++r) {
      vf wv[kBlockVecs];
      Block32<T>(w + r * row_bytes + i * kBlockBytes<T>, dm[2 * r],
                 kHasMin<T> ? dm[2 * r + 1] : 0.0f, wv);
      for (int m = 0; m < M; ++m)
        for (int v = 0; v < kBlockVecs; ++v)
          acc[m][r] += VLoad(x + m * K + i * 32 + v * kVecFloats) * wv[v];
    }
  }
  float sums[M * RR];
  HSumMany(&acc[0][0], M * RR, sums);
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) y[m * N + r] = sums[m * RR + r];
}

typedef void (*FusedFn)(const float*, int64_t, const uint8_t*, int64_t, float*, int64_t);
typedef std::array<std::array<FusedFn, MT + 1>, R + 1> FusedTable;

template <int64_t T, int RR, int... Ms>
constexpr std::array<FusedFn, sizeof...(Ms) + 1> FusedRow(std::integer_sequence<int, Ms...>) {
  return {nullptr, FusedTile<T, Ms + 1, RR>...};
}

template <int64_t T>
const FusedTable kFused = {
    std::array<FusedFn, MT + 1>{},
    FusedRow<T, 1>(std::make_integer_sequence<int, MT>{}),
    FusedRow<T, 2>(std::make_integer_sequence<int, MT>{}),
    FusedRow<T, 3>(std::make_integer_sequence<int, MT>{}),
    FusedRow<T, 4>(std::make_integer_sequence<int, MT>{}),
};

// The fused tiles of a format (nullptr for the K-quants, which take the row buffer).
const FusedTable* FusedFor(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return &kFused<Q4_0>;
    case Q4_1: return &kFused<Q4_1>;
    case Q5_0: return &kFused<Q5_0>;
    case Q5_1: return &kFused<Q5_1>;
    case Q8_0: return &kFused<Q8_0>;
    default: return nullptr;
  }
}

struct Problem {
  const float* x;    // [M, K]
  const uint8_t* w;  // this layer's rows [N][row_bytes]
  float* y;          // [M, N]
  int64_t M, K, N, row_bytes;
  int64_t item_rows;  // output rows per work item (a multiple of the tile's rows of W)
  DequantFn dequant;
  const FusedTable* fused;  // small-M tiles, or nullptr
};

// Rows ahead that a small step prefetches: two groups (one and three measured within noise of
// it, +15-45 % with any against none, on one thread over 94 MB).
constexpr int64_t kPrefetchRows = 2 * R;

// Output rows [n0, n1); a small step prefetches rows up to pf_end (where its thread's walk
// goes on, `ParallelRanges`).
void RunItem(const Problem& p, int64_t n0, int64_t n1, int64_t pf_end, std::vector<float>& buf) {
  if (p.M <= MT && p.fused != nullptr) {
    for (int64_t n = n0; n < n1; n += R) {
      const int rr = int(std::min<int64_t>(R, n1 - n));
      const uint8_t* w = p.w + n * p.row_bytes;
      Prefetch(w + kPrefetchRows * p.row_bytes,
               std::min<int64_t>(pf_end - n - kPrefetchRows, R) * p.row_bytes);
      (*p.fused)[rr][p.M](p.x, p.K, w, p.row_bytes, p.y + n, p.N);
    }
    return;
  }
  buf.resize(RB * p.K);
  for (int64_t n = n0; n < n1; n += RB) {
    const int rr = int(std::min<int64_t>(RB, n1 - n));
    for (int j = 0; j < rr; ++j)
      p.dequant(p.w + (n + j) * p.row_bytes, p.K, &buf[j * p.K]);
    for (int64_t m = 0; m < p.M; m += MT) {
      const int mt = int(std::min<int64_t>(MT, p.M - m));
      kTile[rr][mt](p.x + m * p.K, p.K, buf.data(), p.y + m * p.N + n, p.N);
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
  Problem p;
  const int64_t total_rows = xd[0];
  p.M = std::clamp<int64_t>(rows.typed_data()[0], 0, total_rows);
  p.K = xd[1];
  p.N = y->dimensions()[1];
  p.row_bytes = wd[2];
  p.dequant = Dequantizer(qtype);
  p.fused = FusedFor(qtype);
  if (p.dequant == nullptr) return ffi::Error::InvalidArgument("gguf linear: unknown qtype");
  if (wd[1] != p.N || p.K % block_values || p.K % kVecFloats ||
      p.K / block_values * block_bytes != p.row_bytes)
    return ffi::Error::InvalidArgument("gguf linear: weight shape does not match x and y");
  p.x = x.typed_data();
  p.w = w.typed_data() + l * wd[1] * wd[2];
  p.y = y->typed_data();
  std::fill(p.y + p.M * p.N, p.y + total_rows * p.N, 0.0f);  // padding rows
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  const int64_t threads = pagedjax::Threads(pool);
  // About eight items per thread (load balance), 1 to 4 units each (a unit: 16 rows for the
  // fused tiles, 4 buffers of RB rows otherwise).
  const int64_t unit = p.M <= MT && p.fused != nullptr ? 4 * R : 4 * RB;
  p.item_rows = unit * std::clamp<int64_t>(p.N / (unit * 8 * threads), 1, 4);
  const int64_t items = (p.N + p.item_rows - 1) / p.item_rows;
  pagedjax::ParallelRanges(pool, items, [&p](int64_t i, int64_t end) {
    thread_local std::vector<float> buf;
    const int64_t n0 = i * p.item_rows;
    RunItem(p, n0, std::min(p.N, n0 + p.item_rows), std::min(p.N, end * p.item_rows), buf);
  });
  return ffi::Error::Success();
}

// The float32 values [N, K] of layer `layer` of a stack [L, N, row_bytes]: the large steps'
// weights (`ops.cpu_gguf.dequantize`), which XLA's dot then multiplies. Rows in items of 64
// spread over the threads; each row is the kernel's own DequantRow, so the values are those
// the matmul above multiplies.
ffi::Error GgufDequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> w,
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                          int64_t qtype, int64_t block_values, int64_t block_bytes) {
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (wd.size() != 3 || yd.size() != 2) return ffi::Error::InvalidArgument("gguf dequantize: bad ranks");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("gguf dequantize: layer out of range");
  const int64_t N = wd[1], row_bytes = wd[2], K = yd[1];
  const DequantFn dequant = Dequantizer(qtype);
  if (dequant == nullptr) return ffi::Error::InvalidArgument("gguf dequantize: unknown qtype");
  if (yd[0] != N || K % block_values || K % kVecFloats || K / block_values * block_bytes != row_bytes)
    return ffi::Error::InvalidArgument("gguf dequantize: weight shape does not match the output");
  const uint8_t* src = w.typed_data() + l * N * row_bytes;
  float* out = y->typed_data();
  constexpr int64_t kRows = 64;
  pagedjax::ParallelFor(pool, (N + kRows - 1) / kRows, [&](int64_t i) {
    for (int64_t n = i * kRows; n < std::min(N, (i + 1) * kRows); ++n)
      dequant(src + n * row_bytes, K, out + n * K);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GgufDequantizeCpu, GgufDequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w [L, N, row_bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [N, K]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("block_values")
                                  .Attr<int64_t>("block_bytes"));

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
