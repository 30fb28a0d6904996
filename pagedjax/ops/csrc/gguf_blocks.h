// What the GGUF kernels share (csrc/gguf_linear_cpu.cc, float32 activations, and
// csrc/gguf_int8_cpu.cc, int8 activations): ggml's format ids and block sizes, the f16 scale
// conversions, and the fixed-order lane sum. Block layouts: pagedjax/ops/gguf_quant.py.
#pragma once

#include <cstdint>
#include <cstring>

#include "simd.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pagedjax_gguf {

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

// Formats of 32-value blocks: block bytes, and whether a block carries a min m (w = d q + m).
template <int64_t T>
constexpr int64_t kBlockBytes = T == Q8_0 ? 34 : T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : 24;
template <int64_t T>
constexpr bool kHasMin = T == Q4_1 || T == Q5_1;

// The f16 words at b + i * kBytes + off, i < n, -> d[i] (and, with m, the f16 words two
// bytes later -> m[i]): the scales of a row's 32-value blocks, converted all at once (a
// gather of 32-bit words and a vector conversion on AVX-512; F16C or bits elsewhere).
template <int64_t kBytes>
inline void BlockHalves(const uint8_t* b, int64_t n, float* d, float* m) {
#if defined(PAGEDJAX_ISA_AVX512)
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                           11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(int(kBytes)));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, idx,
                                                  b + i * kBytes, 1);
    _mm512_mask_storeu_ps(d + i, mask, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
    if (m != nullptr)
      _mm512_mask_storeu_ps(m + i, mask,
                            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))));
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    d[i] = Half(b + i * kBytes);
    if (m != nullptr) m[i] = Half(b + i * kBytes + 2);
  }
#endif
}

// The f16 word pairs at the start of one block of each of RR rows (row r at rows + r * stride)
// -> dm[2r] (d) and dm[2r + 1] (the next f16 word: m for the formats with a min): the scales of
// a group of rows converted together, inside a kernel's loop over blocks (one 128-bit load of
// 4 words and one conversion with F16C; converting a row's scales first, with a gather, took
// about a third of the float32 kernel's time on a Zen 4 EPYC, whose gathers are slow).
template <int RR>
inline void GroupHalves(const uint8_t* rows, int64_t stride, float* dm) {
  static_assert(RR >= 1 && RR <= 4, "at most 4 rows");
  uint32_t h[4] = {0, 0, 0, 0};
  for (int r = 0; r < RR; ++r) std::memcpy(&h[r], rows + r * stride, 4);
#if defined(__F16C__)
  _mm256_storeu_ps(dm, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
#else
  for (int r = 0; r < RR; ++r) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&h[r]);
    dm[2 * r] = Half(b);
    dm[2 * r + 1] = Half(b + 2);
  }
#endif
}

// Software prefetch of [p, p + bytes) into the caches, a line at a time: the weight rows of
// the next groups, while this one is computed (the hardware prefetchers follow a kernel's
// four interleaved row streams poorly: one thread read 94 MB of Q4_1 rows at 3.5 GB/s without
// it).
inline void Prefetch(const uint8_t* p, int64_t bytes) {
#if defined(__x86_64__)
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + b), _MM_HINT_T0);
#endif
}

}  // namespace pagedjax_gguf
