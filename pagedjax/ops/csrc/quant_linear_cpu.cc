// y = x @ W[layer] for weight-only int8 and 4-bit (AWQ / GPTQ) weights on CPU, as XLA FFI
// custom calls.
//
// The weights are read in the layout of pagedjax/ops/quant.py, a stack of L layers, in place:
//   int8  q int8 [L][K][N], per-output-channel scales s float32 [L][N]:
//           W[k, n] = q[k, n] * s[n]
//   int4  q int32 [L][K / 8][N] (input row 8r + j of column n in bits 4j .. 4j + 3 of
//           q[r, n], GPTQ's sequential order), per-group scales s float32 [L][G][N] and zero
//           points z int8 [L][G][N], groups of gs = K / G consecutive rows (gs % 8 == 0):
//           W[k, n] = (q[k, n] - z[k / gs, n]) * s[k / gs, n]
// x is float32 [M, K], y float32 [M, N]; the float32 weights are never materialised.
//
// Products are outer products over a panel of PW = NV vectors of output columns: a
// micro-kernel keeps an R x PW block of y in registers and, for each k in order, adds x[m, k]
// broadcast times the panel's k-th row of weights (vectors over n: the [K][N] layout needs no
// transposition). The weight row is dequantized in registers:
//   up to kDirectMaxRows rows of x (decode): straight from the quantized bytes (int8 widened
//     and converted; int4 shifted, masked, its zero subtracted, converted and scaled);
//   more: KC rows of the panel at a time are dequantized into a small float buffer [KC][PW]
//     (in L1 / L2), which every block of MR rows of x then multiplies.
// Both give every output the same chain of fused multiply-adds over k = 0 .. K - 1 (int8:
// then times s[n]; int4: each weight rounded once, (q - z) * s), so a row's result does not
// depend on the number of rows nor on the thread count. Accumulation is in float32.
//
// Only the first `rows` rows of x are multiplied; the others are written as zeros. Work items
// (ranges of panels) are spread over XLA's intra-op thread pool. Vector width from simd.h (one
// build per ISA path). Built by pagedjax/ops/cpu_kernels.py, wrapped by pagedjax/ops/cpu_quant.py.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "parallel.h"
#include "simd.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int NV = kVecRegs == 32 ? 4 : 2;  // vectors per panel row
constexpr int PW = NV * kVecFloats;         // output columns per panel
constexpr int MR = kVecRegs == 32 ? 6 : 5;  // rows of x per buffered micro-kernel call
constexpr int64_t kDirectMaxRows = 4;       // rows of x up to which weights are read directly
constexpr int64_t KC = 128;                 // weight rows per buffered chunk (a multiple of 8)

typedef int32_t viu __attribute__((vector_size(4 * kVecFloats), aligned(4)));

inline vf Int8ToFloat(const int8_t* p) { return __builtin_convertvector(WidenSignedBytes(p), vf); }
inline vi LoadI32(const int32_t* p) { return *reinterpret_cast<const viu*>(p); }

struct Problem {
  const float* x;     // [M, K]
  const void* q;      // this layer's int8 [K][N] or int32 [K / 8][N]
  const float* s;     // this layer's [N] (int8) or [G][N] (int4)
  const int8_t* z;    // this layer's [G][N] (int4), else null
  float* y;           // [M, N]
  int64_t M, K, N;
  int64_t gs;         // rows per group (int4)
  int64_t item_cols;  // output columns per work item (a multiple of PW)
};

// ----------------------------------------------------------------------------- int8

// Direct: y[0:R, n:n+PW] = (x[0:R] @ q[:, n:n+PW]) * s[n:n+PW], a full panel.
template <int R>
void Int8Direct(const Problem& p, int64_t n) {
  const int8_t* q = static_cast<const int8_t*>(p.q) + n;
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  for (int64_t k = 0; k < p.K; ++k) {
    vf w[NV];
    for (int v = 0; v < NV; ++v) w[v] = Int8ToFloat(q + k * p.N + v * kVecFloats);
    for (int r = 0; r < R; ++r) {
      const vf xs = Splat(p.x[r * p.K + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] += xs * w[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      VStore(p.y + r * p.N + n + v * kVecFloats, acc[r][v] * VLoad(p.s + n + v * kVecFloats));
}

// Weight rows [k0, k0 + kc) of the panel at column n (cols of them real) -> buf[kc][PW], the
// int8 values as floats (unscaled), zeros past cols.
void Int8Chunk(const Problem& p, int64_t n, int cols, int64_t k0, int64_t kc, float* buf) {
  const int8_t* q = static_cast<const int8_t*>(p.q) + n;
  for (int64_t k = k0; k < k0 + kc; ++k, buf += PW) {
    if (cols == PW) {
      for (int v = 0; v < NV; ++v) VStore(buf + v * kVecFloats, Int8ToFloat(q + k * p.N + v * kVecFloats));
    } else {
      for (int j = 0; j < PW; ++j) buf[j] = j < cols ? float(q[k * p.N + j]) : 0.0f;
    }
  }
}

// ----------------------------------------------------------------------------- int4

// The 8 weights of rows 8r .. 8r + 7 of one column vector: packed nibbles, zero, scale.
inline vf Int4Weight(vi packed, int j, vi zero, vf scale) {
  return __builtin_convertvector(((packed >> (4 * j)) & 0xF) - zero, vf) * scale;
}

template <int R>
void Int4Direct(const Problem& p, int64_t n) {
  const int32_t* q = static_cast<const int32_t*>(p.q) + n;
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  for (int64_t g = 0; g < p.K / p.gs; ++g) {
    vi zero[NV];
    vf scale[NV];
    for (int v = 0; v < NV; ++v) {
      zero[v] = WidenSignedBytes(p.z + g * p.N + n + v * kVecFloats);
      scale[v] = VLoad(p.s + g * p.N + n + v * kVecFloats);
    }
    for (int64_t o = g * p.gs / 8; o < (g + 1) * p.gs / 8; ++o) {
      vi packed[NV];
      for (int v = 0; v < NV; ++v) packed[v] = LoadI32(q + o * p.N + v * kVecFloats);
      for (int j = 0; j < 8; ++j) {
        vf w[NV];
        for (int v = 0; v < NV; ++v) w[v] = Int4Weight(packed[v], j, zero[v], scale[v]);
        for (int r = 0; r < R; ++r) {
          const vf xs = Splat(p.x[r * p.K + 8 * o + j]);
          for (int v = 0; v < NV; ++v) acc[r][v] += xs * w[v];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) VStore(p.y + r * p.N + n + v * kVecFloats, acc[r][v]);
}

// Rows [k0, k0 + kc) (multiples of 8) of the panel at column n -> buf[kc][PW], dequantized.
void Int4Chunk(const Problem& p, int64_t n, int cols, int64_t k0, int64_t kc, float* buf) {
  const int32_t* q = static_cast<const int32_t*>(p.q) + n;
  for (int64_t o = k0 / 8; o < (k0 + kc) / 8; ++o, buf += 8 * PW) {
    const int64_t g = 8 * o / p.gs;
    const float* s = p.s + g * p.N + n;
    const int8_t* z = p.z + g * p.N + n;
    if (cols == PW) {
      for (int v = 0; v < NV; ++v) {
        const vi packed = LoadI32(q + o * p.N + v * kVecFloats);
        const vi zero = WidenSignedBytes(z + v * kVecFloats);
        const vf scale = VLoad(s + v * kVecFloats);
        for (int j = 0; j < 8; ++j) VStore(buf + j * PW + v * kVecFloats, Int4Weight(packed, j, zero, scale));
      }
    } else {
      for (int j = 0; j < 8; ++j)
        for (int c = 0; c < PW; ++c)
          buf[j * PW + c] =
              c < cols ? float(((q[o * p.N + c] >> (4 * j)) & 0xF) - int32_t(z[c])) * s[c] : 0.0f;
    }
  }
}

// ----------------------------------------------------------------------------- buffered

// y[0:R, 0:cols] (+)= x[0:R, k0:k0+kc] @ buf[kc][PW]; `first` starts from zero, else from y.
template <int R>
void BufMicro(const float* __restrict x, int64_t ldx, int64_t kc, const float* __restrict buf,
              float* __restrict y, int64_t ldy, int cols, bool first) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r) {
    float tmp[PW] = {};
    if (!first) std::memcpy(tmp, y + r * ldy, cols * sizeof(float));
    for (int v = 0; v < NV; ++v) acc[r][v] = first ? vf{} : VLoad(tmp + v * kVecFloats);
  }
  for (int64_t k = 0; k < kc; ++k) {
    vf w[NV];
    for (int v = 0; v < NV; ++v) w[v] = VLoad(buf + k * PW + v * kVecFloats);
    for (int r = 0; r < R; ++r) {
      const vf xs = Splat(x[r * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] += xs * w[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    float tmp[PW];
    for (int v = 0; v < NV; ++v) VStore(tmp + v * kVecFloats, acc[r][v]);
    std::memcpy(y + r * ldy, tmp, cols * sizeof(float));
  }
}

typedef void (*BufFn)(const float*, int64_t, int64_t, const float*, float*, int64_t, int, bool);

template <int... Rs>
constexpr std::array<BufFn, sizeof...(Rs) + 1> BufTable(std::integer_sequence<int, Rs...>) {
  return {nullptr, BufMicro<Rs + 1>...};
}
constexpr auto kBuf = BufTable(std::make_integer_sequence<int, MR>{});

typedef void (*ChunkFn)(const Problem&, int64_t, int, int64_t, int64_t, float*);
typedef void (*DirectFn)(const Problem&, int64_t);

template <bool kInt4>
void RunPanel(const Problem& p, int64_t n, std::vector<float>& buf) {
  const int cols = int(std::min<int64_t>(PW, p.N - n));
  if (cols == PW && p.M <= kDirectMaxRows) {
    static constexpr DirectFn table[2][kDirectMaxRows + 1] = {
        {nullptr, Int8Direct<1>, Int8Direct<2>, Int8Direct<3>, Int8Direct<4>},
        {nullptr, Int4Direct<1>, Int4Direct<2>, Int4Direct<3>, Int4Direct<4>}};
    table[kInt4][p.M](p, n);
    return;
  }
  buf.resize(KC * PW);
  for (int64_t k0 = 0; k0 < p.K; k0 += KC) {
    const int64_t kc = std::min(KC, p.K - k0);
    (kInt4 ? Int4Chunk : Int8Chunk)(p, n, cols, k0, kc, buf.data());
    for (int64_t m = 0; m < p.M; m += MR) {
      const int r = int(std::min<int64_t>(MR, p.M - m));
      kBuf[r](p.x + m * p.K + k0, p.K, kc, buf.data(), p.y + m * p.N + n, p.N, cols, k0 == 0);
    }
  }
  if (!kInt4)  // the per-channel scales, as the direct path applies them
    for (int64_t m = 0; m < p.M; ++m)
      for (int c = 0; c < cols; ++c) p.y[m * p.N + n + c] *= p.s[n + c];
}

ffi::Error Run(ffi::ThreadPool& pool, Problem& p, bool int4, int64_t total_rows) {
  std::fill(p.y + p.M * p.N, p.y + total_rows * p.N, 0.0f);  // padding rows
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  const int64_t threads = pagedjax::Threads(pool);
  // About four items per thread (load balance), one to four panels each.
  p.item_cols = PW * std::clamp<int64_t>(p.N / (PW * 4 * threads), 1, 4);
  const int64_t items = (p.N + p.item_cols - 1) / p.item_cols;
  pagedjax::ParallelFor(pool, items, [&p, int4](int64_t i) {
    thread_local std::vector<float> buf;
    const int64_t n0 = i * p.item_cols, n1 = std::min(p.N, n0 + p.item_cols);
    for (int64_t n = n0; n < n1; n += PW) (int4 ? RunPanel<true> : RunPanel<false>)(p, n, buf);
  });
  return ffi::Error::Success();
}

// Checks shapes and fills the parts of the problem both methods share; null on success.
const char* Setup(Problem& p, ffi::Buffer<ffi::F32>& x, int64_t L, int64_t l, int64_t rows,
                  ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0]) return "quant linear: bad x / y shapes";
  if (l < 0 || l >= L) return "quant linear: layer out of range";
  p.M = std::clamp<int64_t>(rows, 0, xd[0]);
  p.K = xd[1];
  p.N = yd[1];
  p.x = x.typed_data();
  p.y = y->typed_data();
  return nullptr;
}

ffi::Error QuantInt8Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                           ffi::Buffer<ffi::F32> s, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  auto qd = q.dimensions();
  auto sd = s.dimensions();
  if (qd.size() != 3 || sd.size() != 2) return ffi::Error::InvalidArgument("int8 linear: bad ranks");
  Problem p;
  const int64_t l = layer.typed_data()[0];
  if (const char* e = Setup(p, x, qd[0], l, rows.typed_data()[0], y))
    return ffi::Error::InvalidArgument(e);
  if (qd[1] != p.K || qd[2] != p.N || sd[0] != qd[0] || sd[1] != p.N)
    return ffi::Error::InvalidArgument("int8 linear: weight shape does not match x and y");
  p.q = q.typed_data() + l * p.K * p.N;
  p.s = s.typed_data() + l * p.N;
  p.z = nullptr;
  p.gs = p.K;
  return Run(pool, p, false, x.dimensions()[0]);
}

ffi::Error QuantInt4Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> q,
                           ffi::Buffer<ffi::F32> s, ffi::Buffer<ffi::S8> z,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto qd = q.dimensions();
  auto sd = s.dimensions();
  auto zd = z.dimensions();
  if (qd.size() != 3 || sd.size() != 3 || zd.size() != 3)
    return ffi::Error::InvalidArgument("int4 linear: bad ranks");
  Problem p;
  const int64_t l = layer.typed_data()[0];
  if (const char* e = Setup(p, x, qd[0], l, rows.typed_data()[0], y))
    return ffi::Error::InvalidArgument(e);
  const int64_t G = sd[1];
  if (p.K % 8 || qd[1] * 8 != p.K || qd[2] != p.N || G < 1 || p.K % G || (p.K / G) % 8 ||
      sd[0] != qd[0] || sd[2] != p.N || zd[0] != qd[0] || zd[1] != G || zd[2] != p.N)
    return ffi::Error::InvalidArgument("int4 linear: weight shape does not match x and y");
  p.q = q.typed_data() + l * (p.K / 8) * p.N;
  p.s = s.typed_data() + l * G * p.N;
  p.z = z.typed_data() + l * G * p.N;
  p.gs = p.K / G;
  return Run(pool, p, true, x.dimensions()[0]);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantInt8LinearCpu, QuantInt8Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // q [L, K, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // s [L, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows []: rows of x to multiply
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantInt4LinearCpu, QuantInt4Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q [L, K / 8, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // s [L, G, N]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // z [L, G, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
