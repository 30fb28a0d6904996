// 8-float vectors (GCC/Clang vector extensions, mapped to the machine's SIMD by -march=native)
// and their unaligned loads and stores, shared by the native CPU kernels.
#pragma once

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads/stores

inline v8 Load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void Store(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
