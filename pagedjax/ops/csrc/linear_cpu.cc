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
//   - x [M, K] is packed once per call into micro-panels of MR rows, k-major
//     (xp[m / MR][k][MR], zero rows past M), so the micro-kernel reads it as one stream;
//   - up to 128 rows (decode steps; the decode plan), a work item is every row by up to 64
//     output columns (fewer when W is narrow, so that each thread gets about eight), so W is
//     read from memory once per call; above it (prefill), MC rows by 256 columns; for each
//     KC = 256 slice of K, each 16 KB slice of a panel stays in L1 while the row blocks of x
//     pass over it, MC = 8 MR rows at a time so that those stay in L2 (the decode plan cuts K
//     into equal slices of at most KC_DECODE = 512, read from L2, and while a thread computes
//     one item it prefetches the next item's panels into L2, so that the first row block of
//     a slice does not wait on memory: `Prefetch`);
//   - the micro-kernel keeps an MR x (PW * 16) block of y in registers and does its fused
//     multiply-adds per k from PW 16-float rows of W and MR broadcasts of x; MR and PW
//     per ISA path (simd.h): AVX-512 12 x 32 in 24 of 32 zmm registers, AVX2 6 x 16 in
//     12 of 16 ymm registers, portable 3 x 16 in 4-float vectors.
// Only the first `rows` rows of x are multiplied (a runtime operand: a step padded to its
// shape bucket passes its number of real tokens); the rows past it are written as zeros.
// Work items are spread over XLA's intra-op thread pool.
//
// A second handler, GroupedLinear, is the grouped matmul of a mixture-of-experts layer: tiles
// of rows sorted by expert, each run of one expert's tiles multiplied by that expert's
// panels read in place from the [L, E, ...] stack (pagedjax/ops/cpu_linear.py
// `grouped_matmul`), every run's work items in one spread over the threads.
//
// Built on first use by pagedjax/ops/cpu_kernels.py (g++ -O3, the flags of an ISA path).

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Register blocking per ISA path (simd.h): a micro-tile is MR rows of x by PW panels of
// NR = 16 columns of W, MR * PW * NR / kVecFloats accumulators: AVX-512 12 x 32 (24 of its
// 32 registers), AVX2 6 x 16 (12 of 16), portable 3 x 16 (12 of SSE's / NEON's 16+).
// Every element of y is one chain of fused multiply-adds over k in order, whichever
// micro-kernel or row count computes it: a row's result does not depend on the other rows.
#if defined(PAGEDJAX_ISA_AVX512)
constexpr int64_t MR = 12;
constexpr int PW = 2;
#elif defined(PAGEDJAX_ISA_AVX2)
constexpr int64_t MR = 6;
constexpr int PW = 1;
#else
constexpr int64_t MR = 3;
constexpr int PW = 1;
#endif
constexpr int64_t NR = 16;       // columns of W per micro-panel (the packed layout)
constexpr int NV = NR / kVecFloats;  // vectors per panel row
constexpr int64_t KC = 256;      // depth of one slice of a W panel (prefill plan)
constexpr int64_t MC = 8 * MR;   // rows of x per pass over an item's panels
constexpr int64_t NP = 4;        // micro-panels per decode-sized work item at most
constexpr int64_t NCP = 256;     // columns per prefill-sized work item (M > DECODE_ROWS)
// Up to DECODE_ROWS rows of x, every work item takes all of them (the decode plan), so each
// panel of W streams from memory once per call; above it, items of MC rows (the prefill plan)
// read each panel once per MC rows. A KC-deep slice of x's packed panels is then at most
// 128 KB, in L2. (AVX2, 2 threads, alternating in one process, against the prefill plan above
// MC = 48 rows: the 576 x 49152 LM head at M = 64 25.8 against 30.7 ms, 9 of 9 rounds faster;
// 576 x 1536 and 1536 x 576 4-7 % faster at M = 49-128, 576 x 576 within noise; a float32
// decode step of 64 sequences, 128-370 tokens of context, 243.0 against 263.6 ms median,
// faster in 8 of 11 rounds of 10 steps.)
constexpr int64_t DECODE_ROWS = 128;
// Depth of a K slice in the decode plan: every row block of x passes over an item's W slice
// before the next slice, so a deeper slice means fewer partial sums of y written and read back,
// while the slice of x (at most 128 rows x 512 x 4 bytes = 256 KB) stays in L2. A slice's
// micro-kernel continues the chain of y's partial sums (it starts from them), so the bits do
// not depend on where the slices fall: the two plans agree row for row. (Zen 5,
// AVX-512, 2 threads, the 30 layers of the default model plus its LM head in one scan,
// alternating in one process, median of 16: against 256, M = 16 19.5 vs 22.3 ms, 32 28.6 vs
// 35.2, 64 50.1 vs 54.8, 100 71.3 vs 74.3, 128 94.8 vs 99.2; the AVX2 path on the same CPU
// 5-11 % faster at 16-100 rows; 576 and 768 were no better than 512.) With more than MR rows
// K is cut into equal slices of at most this depth (576: two of 288, not 512 and 64) and the
// next item's panels are prefetched (`Prefetch`). Zen 5, 2 threads, the same 30 layers and
// LM head, medians of 21 calls, three processes each way in turn: AVX-512 M = 16 20.9-23.3
// -> 18.8-19.8 ms, 32 30.0-33.4 -> 24.1-24.2, 64 52.9-57.3 -> 46.6-48.0, 128 92.0-98.4 ->
// 86.9-89.9; AVX2 16 33.2-35.8 -> 22.8-24.4, 32 54.9-57.7 -> 43.6-45.6, 64 94.0-98.8 ->
// 77.8-84.0. Measured again hours later, when the same machine was quieter (M = 64 at 41.4
// ms before and after): no difference either way at 16-128 rows, so the gain is where
// memory is slow or shared. (In one process: equal slices without the prefetch were 8 %
// slower than 512 and a tail, the prefetch without them gave about half the gain;
// prefetching two items ahead, into L1, or slices of at most 384 or 256: no better.) Up to
// MR rows (one row block: W is read once, nothing to reuse) neither helped, and that path
// is unchanged.
constexpr int64_t KC_DECODE = 512;
constexpr int64_t kLineBytes = 64;  // a cache line: the unit of `Prefetch`

// Depth of the K slices of a problem of M rows (see KC_DECODE).
int64_t SliceDepth(int64_t M, int64_t K) {
  if (M > DECODE_ROWS) return KC;
  if (M <= MR) return KC_DECODE;
  const int64_t slices = (K + KC_DECODE - 1) / KC_DECODE;
  return std::max<int64_t>(1, (K + slices - 1) / slices);
}

// y[0:R, 0:P * 16] (+)= xp[0:kc][0:R] @ (P panels wp, wp + pstride, ...)[0:kc][0:16];
// ldy is y's row stride. With `accumulate`, the fused multiply-adds start from y's values, so
// that a sum over k split into slices is the same chain as one over all of k. With PF, the
// cache line at pf + kLineBytes j is prefetched into L2 at k = j * pf_every (j = 0, 1, ... while
// k < kc); the result is the same.
template <int R, int P, bool PF>
void Micro(const float* __restrict xp, const float* __restrict wp, int64_t pstride, int64_t kc,
           float* __restrict y, int64_t ldy, bool accumulate, const char* pf, int64_t pf_every) {
  vf acc[R][P * NV];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q)
      for (int v = 0; v < NV; ++v)
        acc[r][q * NV + v] = accumulate ? VLoad(y + r * ldy + q * NR + v * kVecFloats) : vf{};
  int64_t next_pf = 0;
  for (int64_t k = 0; k < kc; ++k) {
    if (PF && k == next_pf) {
      __builtin_prefetch(pf, 0, 2);  // locality 2: prefetcht1, into L2
      pf += kLineBytes;
      next_pf += pf_every;
    }
    vf w[P * NV];
    for (int q = 0; q < P; ++q)
      for (int v = 0; v < NV; ++v) w[q * NV + v] = VLoad(wp + q * pstride + NR * k + v * kVecFloats);
    for (int r = 0; r < R; ++r) {
      const vf xs = Splat(xp[MR * k + r]);
      for (int j = 0; j < P * NV; ++j) acc[r][j] += xs * w[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q)
      for (int v = 0; v < NV; ++v)
        VStore(y + r * ldy + q * NR + v * kVecFloats, acc[r][q * NV + v]);
}

typedef void (*MicroFn)(const float*, const float*, int64_t, int64_t, float*, int64_t, bool,
                        const char*, int64_t);

template <int P, bool PF, size_t... I>
constexpr auto MicroTable(std::index_sequence<I...>) {
  return std::array<MicroFn, MR + 1>{nullptr, Micro<int(I) + 1, P, PF>...};
}
// [prefetching][rows]: one panel, PW panels
constexpr std::array<std::array<MicroFn, MR + 1>, 2> kMicro1 = {
    MicroTable<1, false>(std::make_index_sequence<MR>{}),
    MicroTable<1, true>(std::make_index_sequence<MR>{})};
constexpr std::array<std::array<MicroFn, MR + 1>, 2> kMicroW = {
    MicroTable<PW, false>(std::make_index_sequence<MR>{}),
    MicroTable<PW, true>(std::make_index_sequence<MR>{})};

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // this layer's panels [ceil(N / NR)][K][NR]
  float* y;        // [M, N]
  int64_t M, K, N;
  int64_t item_cols;      // output columns per work item (a multiple of NR)
  int64_t item_rows;      // rows of x per work item (a multiple of MR, or M)
  int64_t col_items;      // work items across N
  // packed x: [ceil(M / MR)][K][MR], allocated without zeroing (PackBlock writes every float)
  std::unique_ptr<float[]> xp;
};

// Rows [b * MR, b * MR + MR) of x into micro-panel b of xp (zero rows past M). k outermost:
// each k's MR floats are stored together (a full block's loop unrolls into MR loads from MR
// row streams and one contiguous run of stores). Against rows outermost, which stored with a
// stride of MR floats across a block larger than L1 at K = 1536, into a buffer zeroed first:
// one core, CPU time per call, best of 5 x 40 calls, three alternating runs on an Intel Xeon
// (AVX-512): [2048, 1536] @ [1536, 576] 29.2-32.6 against 33.2-37.6 ms, [2048, 576] @
// [576, 960] 18.7-21.8 against 18.5-22.9 ms; the outputs are bit-identical.
void PackBlock(Problem& p, int64_t b) {
  float* dst = p.xp.get() + b * MR * p.K;
  const float* src = p.x + b * MR * p.K;
  const int64_t rows = std::min(MR, p.M - b * MR), K = p.K;
  if (rows == MR) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < MR; ++r) dst[k * MR + r] = src[r * K + k];
    return;
  }
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t r = 0; r < rows; ++r) dst[k * MR + r] = src[r * K + k];
    for (int64_t r = rows; r < MR; ++r) dst[k * MR + r] = 0.0f;
  }
}

// Cache lines to prefetch while an item is computed (the next item's panels), handed out in
// equal shares to the item's micro-kernel calls, each spreading its share over its k loop.
struct Prefetch {
  const char* next = nullptr;  // the next line to prefetch
  int64_t lines = 0;           // lines left
  int64_t per_call = 0;        // lines per micro-kernel call

  // This call's share for a k loop of kc: sets *every (k between prefetches); returns its
  // first line, or nullptr when nothing is left.
  const char* Take(int64_t kc, int64_t* every) {
    const int64_t n = std::min(per_call, lines);
    if (n <= 0) return nullptr;
    *every = std::max<int64_t>(1, kc / n);
    const int64_t issued = std::min(n, (kc + *every - 1) / *every);
    const char* first = next;
    next += issued * kLineBytes;
    lines -= issued;
    return first;
  }
};

// Output rows [m_lo, m_hi) x columns [j0, j0 + cols), cols <= item_cols; prefetches
// `pf_lines` cache lines from `pf` (0: none) along the way.
void RunItem(const Problem& p, int64_t m_lo, int64_t m_hi, int64_t j0, int64_t cols,
             const char* pf = nullptr, int64_t pf_lines = 0) {
  alignas(64) float tile[MR * NR];  // a partial micro-panel's output, before its copy to y
  const int64_t panels = (cols + NR - 1) / NR;
  const int64_t pstride = p.K * NR;  // floats between consecutive panels
  const int64_t KS = SliceDepth(p.M, p.K);
  Prefetch prefetch;
  if (pf != nullptr && pf_lines > 0) {
    const int64_t col_steps = cols / (PW * NR) + (cols % (PW * NR) + NR - 1) / NR;
    const int64_t calls = (p.K + KS - 1) / KS * col_steps * ((m_hi - m_lo + MR - 1) / MR);
    prefetch = {pf, pf_lines, (pf_lines + calls - 1) / calls};
  }
  for (int64_t k0 = 0; k0 < p.K; k0 += KS) {
    const int64_t kc = std::min(KS, p.K - k0);
    for (int64_t mc0 = m_lo; mc0 < m_hi; mc0 += MC) {
      const int64_t mc1 = std::min(m_hi, mc0 + MC);
      for (int64_t q = 0; q < panels;) {
        const int64_t c0 = j0 + q * NR;
        const int64_t width = std::min(NR, cols - q * NR);
        // PW full panels at once where the item has them, else one.
        const bool wide = cols - q * NR >= PW * NR;
        const int64_t step = wide ? PW : 1;
        const float* panel = p.w + (c0 / NR) * pstride + k0 * NR;
        for (int64_t m0 = mc0; m0 < mc1; m0 += MR) {
          const int64_t rows = std::min(MR, p.M - m0);
          const float* xp = p.xp.get() + m0 * p.K + k0 * MR;
          float* y = p.y + m0 * p.N + c0;
          int64_t every = 0;
          const char* cpf = prefetch.Take(kc, &every);
          const int with_pf = cpf != nullptr;
          if (wide) {
            kMicroW[with_pf][rows](xp, panel, pstride, kc, y, p.N, k0 > 0, cpf, every);
          } else if (width == NR) {
            kMicro1[with_pf][rows](xp, panel, pstride, kc, y, p.N, k0 > 0, cpf, every);
          } else {
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c = 0; c < NR; ++c) tile[r * NR + c] = c < width ? y[r * p.N + c] : 0.0f;
            kMicro1[with_pf][rows](xp, panel, pstride, kc, tile, NR, k0 > 0, cpf, every);
            for (int64_t r = 0; r < rows; ++r)
              std::memcpy(y + r * p.N, tile + r * NR, width * sizeof(float));
          }
        }
        q += step;
      }
    }
  }
}

using pagedjax::ParallelFor;

// Packs x into p.xp: serially for a decode-sized problem, else over the threads.
void PackAll(ffi::ThreadPool& pool, Problem& p) {
  const int64_t blocks = (p.M + MR - 1) / MR;
  p.xp.reset(new float[blocks * MR * p.K]);
  if (p.M <= MC) {
    for (int64_t b = 0; b < blocks; ++b) PackBlock(p, b);
  } else {  // prefill-sized: packing x is worth spreading over the threads too
    ParallelFor(pool, (blocks + 7) / 8, [&](int64_t i) {
      for (int64_t b = 8 * i; b < std::min(blocks, 8 * i + 8); ++b) PackBlock(p, b);
    });
  }
}

// Sets p's work items (item_rows, item_cols, col_items) for `threads` threads; returns
// their number.
int64_t PlanItems(Problem& p, int64_t threads) {
  if (p.M <= DECODE_ROWS) {
    // Decode-sized: all rows in each item; narrow items when W has few columns, so that
    // every thread gets several (load balance).
    p.item_rows = p.M;
    p.item_cols = NR * PW * std::clamp<int64_t>(p.N / (NR * PW * 8 * threads), 1, NP / PW);
  } else {
    // Prefill-sized: items of MC rows x NCP columns, so that a KC x MC block of x, in L2,
    // serves NCP / NR / PW micro-tile columns before the next is read.
    p.item_rows = MC;
    p.item_cols = std::min<int64_t>(NCP, (p.N + NR * PW - 1) / (NR * PW) * NR * PW);
  }
  p.col_items = (p.N + p.item_cols - 1) / p.item_cols;
  return p.col_items * ((p.M + p.item_rows - 1) / p.item_rows);
}

// Work item i of PlanItems' plan; with next >= 0, item `next`'s panels (its columns of W over
// all of K) are prefetched into L2 meanwhile.
void RunPlanned(const Problem& p, int64_t i, int64_t next = -1) {
  const int64_t j0 = (i % p.col_items) * p.item_cols, m0 = (i / p.col_items) * p.item_rows;
  const char* pf = nullptr;
  int64_t pf_lines = 0;
  if (next >= 0) {
    const int64_t n0 = (next % p.col_items) * p.item_cols;
    const int64_t next_panels = (std::min(p.item_cols, p.N - n0) + NR - 1) / NR;
    pf = reinterpret_cast<const char*>(p.w + (n0 / NR) * p.K * NR);
    pf_lines = next_panels * p.K * NR * int64_t(sizeof(float)) / kLineBytes;
  }
  RunItem(p, m0, std::min(p.M, m0 + p.item_rows), j0, std::min(p.item_cols, p.N - j0), pf,
          pf_lines);
}

ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4) return ffi::Error::InvalidArgument("linear: bad ranks");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("linear: layer out of range");
  Problem p;
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
  PackAll(pool, p);
  const int64_t items = PlanItems(p, pagedjax::Threads(pool));
  // Decode-plan items are column ranges of W in memory order: one contiguous run of them per
  // thread (`ParallelRanges`; a float32 decode step of one sequence, in one process in
  // alternating blocks of 20 steps against interleaved items: 1.25 ms faster of 31, median of
  // 16 rounds, faster in 13). With more than one row block, each item prefetches the next of
  // its thread's run (see KC_DECODE).
  if (p.M <= DECODE_ROWS)
    pagedjax::ParallelRanges(pool, items, [&p](int64_t i, int64_t end) {
      RunPlanned(p, i, p.M > MR && i + 1 < end ? i + 1 : -1);
    });
  else
    ParallelFor(pool, items, [&p](int64_t i) { RunPlanned(p, i); });
  return ffi::Error::Success();
}

// The grouped matmul of a mixture-of-experts layer: y[t] = x[t] @ W[layer, expert[t]] for
// tiles t of m rows. Consecutive tiles of one expert are one problem (the expert's rows of
// the step, read against its weight once); the problems' work items share one ParallelFor,
// so that both threads stay busy however the rows fall. A tile whose expert is outside
// [0, E) (assignments to experts held on another device) is written as zeros. Each output
// element is the same chain of fused multiply-adds as Linear's: a row's result does not
// depend on the other rows of its tile, its group or its step.
ffi::Error GroupedLinear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> expert,
                         ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 3 || wd.size() != 5 || expert.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("grouped linear: bad ranks");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("grouped linear: layer out of range");
  const int64_t tiles = xd[0], m = xd[1], K = xd[2], E = wd[1], N = y->dimensions()[2];
  if (expert.dimensions()[0] != tiles || wd[3] != K || wd[4] != NR || wd[2] * NR < N)
    return ffi::Error::InvalidArgument("grouped linear: bad pre-packed weight shape");
  const int32_t* ex = expert.typed_data();
  const int64_t expert_floats = wd[2] * wd[3] * wd[4];
  std::vector<Problem> groups;
  for (int64_t t0 = 0; t0 < tiles;) {
    int64_t t1 = t0 + 1;
    while (t1 < tiles && ex[t1] == ex[t0]) ++t1;
    float* yt = y->typed_data() + t0 * m * N;
    if (ex[t0] < 0 || ex[t0] >= E || K == 0) {
      std::fill(yt, yt + (t1 - t0) * m * N, 0.0f);
    } else if (m > 0 && N > 0) {
      Problem& p = groups.emplace_back();
      p.x = x.typed_data() + t0 * m * K;
      p.w = w.typed_data() + (l * E + ex[t0]) * expert_floats;
      p.y = yt;
      p.M = (t1 - t0) * m;
      p.K = K;
      p.N = N;
    }
    t0 = t1;
  }
  const int64_t threads = pagedjax::Threads(pool);
  std::vector<int64_t> first_item(groups.size() + 1, 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    PackAll(pool, groups[g]);
    first_item[g + 1] = first_item[g] + PlanItems(groups[g], threads);
  }
  ParallelFor(pool, first_item.back(), [&](int64_t i) {
    const size_t g = std::upper_bound(first_item.begin(), first_item.end(), i) - first_item.begin() - 1;
    RunPlanned(groups[g], i - first_item[g]);
  });
  return ffi::Error::Success();
}

}  // namespace

// The ISA path this library was built for ("avx512", "avx2" or "portable"; see simd.h).
extern "C" const char* PagedjaxKernelIsa() { return kIsaName; }

// Caps the threads of every later kernel call of this library (parallel.h's ThreadLimit);
// limit <= 0 lifts the cap.
extern "C" void PagedjaxSetThreadLimit(int64_t limit) {
  pagedjax::ThreadLimit().store(std::max<int64_t>(limit, 0), std::memory_order_relaxed);
}

// The cap in force (0: none).
extern "C" int64_t PagedjaxThreadLimit() {
  return pagedjax::ThreadLimit().load(std::memory_order_relaxed);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearCpu, Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [L, ceil(N / 16), K, 16]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows []: rows of x to multiply
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedLinearCpu, GroupedLinear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [tiles, m, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [L, E, ceil(N / 16), K, 16]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // expert [tiles]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [tiles, m, N]
