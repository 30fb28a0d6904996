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
// scales where the path has it).
//
// Products, by the number of rows of x:
//   up to kDotMaxRows (decode): NB = 4 rows of W dequantized, then a dot product over K per
//     (row of x, row of W), lanes summed pairwise in a fixed order (`TreeSum`);
//   more: PW = 16 rows of W dequantized and transposed into a panel [K][16], and a
//     micro-kernel keeps an MR x 16 block of y in 12 vector registers, adding x[m, k]
//     broadcast times the panel's row k (outer products, no horizontal sums).
// The result does not depend on the thread count. Vector width comes from simd.h (AVX-512,
// AVX2 or the portable 4-float path, one build each).
//
// Only the first `rows` rows of x are multiplied (a step padded to its shape bucket passes its
// number of real tokens); the others are written as zeros. Work items are spread over XLA's
// intra-op thread pool. Built by pagedjax/ops/cpu_kernels.py.

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "simd.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int NB = 4;  // rows of W dequantized together for dot products (small M)

// ggml's type ids (pagedjax/ops/gguf_quant.py GGML_TYPE_IDS).
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// IEEE half (little-endian bytes) -> float: F16C where the path has it, else by bits
// (normals, subnormals, inf and NaN).
inline float Half(const uint8_t* p) {
  const uint16_t h = uint16_t(p[0] | (p[1] << 8));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t(h) & 0x8000u) << 16;
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
#endif
}

typedef int8_t vsbu __attribute__((vector_size(kVecFloats), aligned(1)));  // signed bytes

// kVecFloats bytes -> int32 lanes, zero- (U8) or sign-extended (S8): one vpmovzxbd /
// vpmovsxbd on x86 (GCC's __builtin_convertvector widens lane by lane).
inline vi WidenU8(const uint8_t* p) {
#if defined(PAGEDJAX_ISA_AVX512)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(PAGEDJAX_ISA_AVX2)
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(__SSE4_1__)
  int32_t word;
  std::memcpy(&word, p, 4);
  return (vi)_mm_cvtepu8_epi32(_mm_cvtsi32_si128(word));
#else
  return __builtin_convertvector(*reinterpret_cast<const vbu*>(p), vi);
#endif
}

inline vi WidenS8(const uint8_t* p) {
#if defined(PAGEDJAX_ISA_AVX512)
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(PAGEDJAX_ISA_AVX2)
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(__SSE4_1__)
  int32_t word;
  std::memcpy(&word, p, 4);
  return (vi)_mm_cvtepi8_epi32(_mm_cvtsi32_si128(word));
#else
  return __builtin_convertvector(*reinterpret_cast<const vsbu*>(p), vi);
#endif
}

inline vi Iota() {
  vi v;
  for (int i = 0; i < kVecFloats; ++i) v[i] = i;
  return v;
}

// A 32-value block's 16 nibble bytes -> out[0:32] = d * q + m (value j from the low half of
// byte j, value j + 16 from its high half); with qh, bit j of qh is value j's fifth bit.
template <bool kFifth>
inline void Nibbles32(const uint8_t* qs, uint32_t qh, float d, float m, float* out) {
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
    VStore(out + c, dv * __builtin_convertvector(lo, vf) + mv);
    VStore(out + 16 + c, dv * __builtin_convertvector(hi, vf) + mv);
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

// One row of K values -> out[0:K]. The inner loops have fixed trip counts and no branches,
// so the compiler vectorizes them.
template <int64_t T>
void DequantRow(const uint8_t* __restrict b, int64_t K, float* __restrict out) {
  if constexpr (T == Q8_0) {
    for (int64_t i = 0; i < K / 32; ++i, b += 34, out += 32) {
      const vf d = Splat(Half(b));
      for (int c = 0; c < 32; c += kVecFloats) {
        const vi q = WidenS8(b + 2 + c);
        VStore(out + c, d * __builtin_convertvector(q, vf));
      }
    }
  } else if constexpr (T == Q4_0 || T == Q4_1) {
    constexpr int64_t bytes = T == Q4_0 ? 18 : 20;
    for (int64_t i = 0; i < K / 32; ++i, b += bytes, out += 32) {
      const float d = Half(b);
      const float m = T == Q4_1 ? Half(b + 2) : -8.0f * d;
      Nibbles32<false>(b + (T == Q4_0 ? 2 : 4), 0, d, m, out);
    }
  } else if constexpr (T == Q5_0 || T == Q5_1) {
    constexpr int64_t bytes = T == Q5_0 ? 22 : 24;
    for (int64_t i = 0; i < K / 32; ++i, b += bytes, out += 32) {
      const float d = Half(b);
      const float m = T == Q5_1 ? Half(b + 2) : -16.0f * d;
      const uint8_t* hb = b + (T == Q5_0 ? 2 : 4);
      const uint32_t qh = uint32_t(hb[0]) | (uint32_t(hb[1]) << 8) | (uint32_t(hb[2]) << 16) |
                          (uint32_t(hb[3]) << 24);
      Nibbles32<true>(hb + 4, qh, d, m, out);
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

// Lanes summed pairwise (a fixed tree: the same order in every call).
inline float TreeSum(vf x) {
  float a[kVecFloats];
  std::memcpy(a, &x, sizeof(a));
  for (int w = kVecFloats / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

// Small M (dot products over K): y[0, j] = dot(x[0, :], w[j, :]) for j < J, w J dequantized
// rows [J][K].
template <int J>
inline void DotBlock(const float* __restrict x, const float* __restrict w, int64_t K,
                     float* __restrict y) {
  vf acc[J];
  for (int j = 0; j < J; ++j) acc[j] = vf{};
  for (int64_t k = 0; k < K; k += kVecFloats) {
    const vf xv = VLoad(x + k);
    for (int j = 0; j < J; ++j) acc[j] += xv * VLoad(w + j * K + k);
  }
  for (int j = 0; j < J; ++j) y[j] = TreeSum(acc[j]);
}

template <int J>
void DotRows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m) DotBlock<J>(x + m * K, w, K, y + m * N);
}

// Larger M (outer products): PW = 16 dequantized rows transposed into a panel [K][16]; a
// micro-kernel keeps an MR x 16 block of y in registers (MR * 16 / kVecFloats = 12 vector
// accumulators) and adds, for each k, x[m, k] broadcast times the panel's row k.
constexpr int PW = 16;
constexpr int NV = PW / kVecFloats;  // vectors per panel row
constexpr int MR = 12 / NV;          // rows of x per micro-kernel call

template <int R>
void PanelMicro(const float* __restrict x, int64_t K, const float* __restrict panel,
                float* __restrict y, int64_t ldy, int cols) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    vf wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = VLoad(panel + k * PW + v * kVecFloats);
    for (int r = 0; r < R; ++r) {
      const vf xs = Splat(x[r * K + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] += xs * wv[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    if (cols == PW) {
      for (int v = 0; v < NV; ++v) VStore(y + r * ldy + v * kVecFloats, acc[r][v]);
    } else {
      float tmp[PW];
      for (int v = 0; v < NV; ++v) VStore(tmp + v * kVecFloats, acc[r][v]);
      std::memcpy(y + r * ldy, tmp, cols * sizeof(float));
    }
  }
}

typedef void (*PanelFn)(const float*, int64_t, const float*, float*, int64_t, int);

template <int... Rs>
constexpr std::array<PanelFn, sizeof...(Rs) + 1> PanelTable(std::integer_sequence<int, Rs...>) {
  return {nullptr, PanelMicro<Rs + 1>...};
}
constexpr auto kPanel = PanelTable(std::make_integer_sequence<int, MR>{});

struct Problem {
  const float* x;    // [M, K]
  const uint8_t* w;  // this layer's rows [N][row_bytes]
  float* y;          // [M, N]
  int64_t M, K, N, row_bytes;
  int64_t item_rows;  // output rows per work item (a multiple of NB)
  DequantFn dequant;
};

// Rows of x up to which a step uses dot products (above: outer products on a panel).
constexpr int64_t kDotMaxRows = 8;

void RunItem(const Problem& p, int64_t n0, int64_t n1, std::vector<float>& buf) {
  if (p.M <= kDotMaxRows) {
    buf.resize(NB * p.K);
    for (int64_t n = n0; n < n1; n += NB) {
      const int64_t rows = std::min<int64_t>(NB, n1 - n);
      for (int64_t j = 0; j < rows; ++j) p.dequant(p.w + (n + j) * p.row_bytes, p.K, &buf[j * p.K]);
      float* y = p.y + n;
      switch (rows) {
        case 4: DotRows<4>(p.x, p.M, p.K, buf.data(), y, p.N); break;
        case 3: DotRows<3>(p.x, p.M, p.K, buf.data(), y, p.N); break;
        case 2: DotRows<2>(p.x, p.M, p.K, buf.data(), y, p.N); break;
        default: DotRows<1>(p.x, p.M, p.K, buf.data(), y, p.N); break;
      }
    }
    return;
  }
  buf.resize(2 * PW * p.K);
  float* rows_buf = buf.data();          // [PW][K]
  float* panel = buf.data() + PW * p.K;  // [K][PW]
  for (int64_t n = n0; n < n1; n += PW) {
    const int cols = int(std::min<int64_t>(PW, n1 - n));
    for (int j = 0; j < cols; ++j) p.dequant(p.w + (n + j) * p.row_bytes, p.K, rows_buf + j * p.K);
    for (int64_t k = 0; k < p.K; ++k) {
      for (int j = 0; j < cols; ++j) panel[k * PW + j] = rows_buf[j * p.K + k];
      for (int j = cols; j < PW; ++j) panel[k * PW + j] = 0.0f;
    }
    for (int64_t m = 0; m < p.M; m += MR) {
      const int r = int(std::min<int64_t>(MR, p.M - m));
      kPanel[r](p.x + m * p.K, p.K, panel, p.y + m * p.N + n, p.N, cols);
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
  // About eight items per thread (load balance), 16 to 64 rows each (a multiple of the panel).
  p.item_rows = PW * std::clamp<int64_t>(p.N / (PW * 8 * threads), 1, 4);
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
