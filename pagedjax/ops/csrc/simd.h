// The vector width of the native CPU kernels, chosen at build time, and the vector types and
// helpers the kernels share.
//
// ISA paths. The build (pagedjax/ops/cpu_kernels.py) compiles one library per path, defining
// exactly one of these macros together with the compiler flags that enable its instructions:
//   PAGEDJAX_ISA_AVX512    16-float vectors, 32 vector registers (x86 AVX-512 F/BW/VL/DQ + FMA);
//                          flags: -march=native on such a CPU.
//   PAGEDJAX_ISA_AVX2      8-float vectors, 16 vector registers (x86 AVX2 + FMA);
//                          flags: -march=native -mno-avx512f.
//   PAGEDJAX_ISA_PORTABLE  4-float GCC/Clang vectors, mapped by the compiler to whatever the
//                          target has (SSE2, NEON) or to scalar code; flags: -march=native
//                          -mno-avx on x86 (SSE4 at most), -march=native elsewhere.
// A kernel written with `vf` (kVecFloats floats), `VLoad` / `VStore` / `Splat` / `HSum`
// runs on every path; code that wants its own register blocking reads kVecFloats and
// kVecRegs. Without a macro (a compile outside the build) the widest path the compiler's own
// flags allow is taken; a macro the flags do not allow is an error.
//
// `v8` / `Load` / `Store` (8-float vectors) are kept for code written before the paths
// existed; on the AVX-512 path they use the low half of the registers only.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if !defined(PAGEDJAX_ISA_AVX512) && !defined(PAGEDJAX_ISA_AVX2) && \
    !defined(PAGEDJAX_ISA_PORTABLE)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__FMA__)
#define PAGEDJAX_ISA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEDJAX_ISA_AVX2 1
#else
#define PAGEDJAX_ISA_PORTABLE 1
#endif
#endif

#if defined(PAGEDJAX_ISA_AVX512)
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
      defined(__AVX512DQ__) && defined(__FMA__))
#error "PAGEDJAX_ISA_AVX512 needs -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma"
#endif
constexpr int kVecFloats = 16;
constexpr int kVecRegs = 32;
constexpr const char* kIsaName = "avx512";
#elif defined(PAGEDJAX_ISA_AVX2)
#if !(defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#error "PAGEDJAX_ISA_AVX2 needs -mavx2 -mfma and no -mavx512f"
#endif
constexpr int kVecFloats = 8;
constexpr int kVecRegs = 16;
constexpr const char* kIsaName = "avx2";
#else
#if defined(__AVX__)
#error "PAGEDJAX_ISA_PORTABLE is built with -mno-avx on x86"
#endif
constexpr int kVecFloats = 4;
constexpr int kVecRegs = 16;
constexpr const char* kIsaName = "portable";
#endif

// kVecFloats floats / int32s / bytes; vfu is vf for unaligned memory.
typedef float vf __attribute__((vector_size(4 * kVecFloats)));
typedef float vfu __attribute__((vector_size(4 * kVecFloats), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * kVecFloats)));
typedef uint8_t vb __attribute__((vector_size(kVecFloats)));

inline vf VLoad(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void VStore(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
// Every lane s. On x86 the set1 intrinsic, which the compiler makes one vbroadcastss from
// memory (a load-port uop): `vf{} + s` compiled to a scalar add and a register broadcast on the
// shuffle port, which the matmul micro-kernel's FMAs share; the native float32 matmul ran at
// 73-113 GFLOP/s at M = 512-2048 with it and 172-195 without (AVX-512, 2 cores, peak 248).
inline vf Splat(float s) {
#if defined(PAGEDJAX_ISA_AVX512)
  return (vf)_mm512_set1_ps(s);
#elif defined(PAGEDJAX_ISA_AVX2)
  return (vf)_mm256_set1_ps(s);
#elif defined(__SSE__)
  return (vf)_mm_set1_ps(s);
#else
  return vf{} + s;  // (a lane-by-lane fill compiled to inserts: 6x slower in the GGUF kernel)
#endif
}
// Lanes summed in a fixed tree, so that a row's sum is the same in every call: lane i with
// lane i + W / 2, then i with i + W / 4, ... (the same pairs on every path's own width W).
// Used by the GGUF kernels' dot products and the attention kernel's scores; the attention
// kernel once summed lane by lane in order (a chain of W dependent scalar adds), which took
// 26-32 us against 15-17 us for one sequence of 200 tokens (AVX-512, 9 heads of 64, one
// thread).
inline float HSum(vf x) {
#if defined(PAGEDJAX_ISA_AVX512)
  const __m512 v = (__m512)x;
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
#elif defined(PAGEDJAX_ISA_AVX2)
  const __m256 v = (__m256)x;
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
#else
  float a[kVecFloats];
  std::memcpy(a, &x, sizeof(a));
  for (int w = kVecFloats / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
#endif
}

// The largest of floats [lo, hi) of p (hi > lo): lanes of kVecFloats compared in vectors, then
// the lanes and the tail. A maximum does not round, so any order gives the same value (NaN
// aside: a NaN compares false and is skipped unless p[lo] is one). Written for the attention
// kernel's softmax, whose row maximum was a chain of dependent scalar max instructions (4
// cycles each): 21 % of a prefill chunk's attention time on an Intel Xeon.
inline float MaxOf(const float* p, int64_t lo, int64_t hi) {
  float mx = p[lo];
  int64_t i = lo + 1;
  if (hi - i >= kVecFloats) {
    vf m = Splat(mx);
    for (; i + kVecFloats <= hi; i += kVecFloats) {
      const vf x = VLoad(p + i);
      m = x > m ? x : m;
    }
    float lanes[kVecFloats];
    std::memcpy(lanes, &m, sizeof(lanes));
    for (int j = 0; j < kVecFloats; ++j) mx = lanes[j] > mx ? lanes[j] : mx;
  }
  for (; i < hi; ++i) mx = p[i] > mx ? p[i] : mx;
  return mx;
}

// HSum of n vectors: out[i] = HSum(v[i]), the same bits. On AVX-512, 16 vectors at a time
// go through the same tree in transposed form (each level adds the same lane pairs of 2, 4, 8
// and 16 vectors at once: 45 vector operations for 16 sums, against 8 per sum), a group short
// of 16 padded with zero vectors; under 6 vectors left, one by one. (The GGUF kernel's 4 x 6
// tiles, one thread, M = 64, alternating runs: 3,703-3,886 against 4,076-4,137 us for a
// 576 x 3072 Q4_1 layer, 2,181 against 2,213 for 1536 x 576; at M = 2, 205 against 219.)
inline void HSumMany(const vf* v, int n, float* out) {
  int i = 0;
#if defined(PAGEDJAX_ISA_AVX512)
  for (; n - i >= 6; i += 16) {
    __m512 x[16];
    for (int j = 0; j < 16; ++j) x[j] = i + j < n ? (__m512)v[i + j] : _mm512_setzero_ps();
    __m512 s1[8], s2[4], s3[2];
    for (int j = 0; j < 8; ++j)  // lanes k and k + 8 of each vector
      s1[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int j = 0; j < 4; ++j) {  // then k and k + 4: quarter q holds vector 4 j + q
      const __m512 a = s1[2 * j], b = s1[2 * j + 1];
      s2[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    for (int j = 0; j < 2; ++j)  // then k and k + 2
      s3[j] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * j], s2[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_ps(s2[2 * j], s2[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // then k and k + 1: lane 4 q + j holds the sum of vector 4 j + q
    const __m512 s4 = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 sums = _mm512_permutexvar_ps(order, s4);
    _mm512_mask_storeu_ps(out + i, n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1),
                          sums);
  }
#endif
  for (; i < n; ++i) out[i] = HSum(v[i]);
}

// kVecFloats bytes zero-extended to int32 lanes: GCC 12 compiles __builtin_convertvector of a
// byte vector into byte-by-byte scalar loads and inserts (5x slower over a float8 block than
// vpmovzxbd), so the x86 paths use the intrinsic.
inline vi WidenBytes(const void* p) {
#if defined(PAGEDJAX_ISA_AVX512)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(PAGEDJAX_ISA_AVX2)
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(__SSE4_1__)
  int32_t word;
  std::memcpy(&word, p, 4);
  return (vi)_mm_cvtepu8_epi32(_mm_cvtsi32_si128(word));
#else
  vb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
#endif
}

// kVecFloats signed bytes sign-extended to int32 lanes (vpmovsxbd on x86).
inline vi WidenSignedBytes(const void* p) {
#if defined(PAGEDJAX_ISA_AVX512)
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(PAGEDJAX_ISA_AVX2)
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(__SSE4_1__)
  int32_t word;
  std::memcpy(&word, p, 4);
  return (vi)_mm_cvtepi8_epi32(_mm_cvtsi32_si128(word));
#else
  typedef int8_t vsb __attribute__((vector_size(kVecFloats)));
  vsb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
#endif
}

// float8 -> float32 of kVecFloats bytes, in registers, for a format with E exponent bits,
// M mantissa bits and exponent bias B (e4m3fn: 4, 3, 7; e5m2: 5, 2, 15): a normal number
// moves its exponent and mantissa bits into float32's fields and rebiases the exponent by an
// integer add; a subnormal one (exponent 0) is m * 2^(1 - B - M), exact in float32. Inf and
// NaN bytes are not special-cased (a quantized cache is saturated to finite values).
//
// On x86 (F16C, which every AVX2 and AVX-512 CPU has) the two formats go through the
// half-precision converter instead, with the same values in about half the operations: an
// e5m2 byte is the high byte of the float16 of its value; an e4m3fn byte shifted so that its
// exponent and mantissa fields sit on float16's (sign kept) is the float16 of value * 2^-8
// (exponent bias 15 against 7; subnormals line up the same way), multiplied back by 2^8,
// exactly. Only e5m2's Inf and NaN bytes, which a saturated cache never holds, come out
// differently: Inf and NaN here, finite numbers below. (The bit-field path below cost more
// per block than the block's scores and weighted sums: 30 layers of attention over 64
// sequences of a float8 cache, AVX2, 29.7 ms against 25.1 with the converter.)
template <int E, int M, int B>
inline vf Float8ToFloat(const uint8_t* p) {
#if defined(__F16C__) && (defined(PAGEDJAX_ISA_AVX2) || defined(PAGEDJAX_ISA_AVX512))
  static_assert((E == 4 && M == 3 && B == 7) || (E == 5 && M == 2 && B == 15),
                "float8 formats: e4m3fn, e5m2");
#if defined(PAGEDJAX_ISA_AVX512)
  const __m256i x = _mm256_slli_epi16(
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  const __m256i h = E == 5 ? x
                           : _mm256_and_si256(_mm256_srai_epi16(x, 1),
                                              _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const vf f = (vf)_mm512_cvtph_ps(h);
#else
  const __m128i x = _mm_slli_epi16(
      _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
  const __m128i h = E == 5 ? x
                           : _mm_and_si128(_mm_srai_epi16(x, 1),
                                           _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const vf f = (vf)_mm256_cvtph_ps(h);
#endif
  return E == 5 ? f : f * 256.0f;
#else
  const vi x = WidenBytes(p);
  const vi sign = (x & 0x80) << 24;
  const vi em = x & 0x7f;                  // exponent and mantissa bits
  const vi normal = (em << (23 - M)) + ((127 - B) << 23);
  const vf sub = __builtin_convertvector(em & ((1 << M) - 1), vf) *
                 (1.0f / float(1ull << (B + M - 1)));  // m * 2^(1 - B - M)
  const vi mag = (em >> M) == 0 ? (vi)sub : normal;
  return (vf)(mag | sign);
#endif
}

// 8-float vectors, for code written before the paths existed.
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads/stores

inline v8 Load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void Store(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
