// The KV-cache write of one layer on CPU, as an XLA FFI custom call: the step's new K and V
// rows (already in the cache's dtype) copied into their slots, the caches updated in place.
//
// Why: XLA's CPU scatter into a float8 array makes a pass over the whole cache (and the
// uint8 view that avoids it costs bitcasts of the whole cache); this call touches only the
// T new rows. The caches are operands aliased to the results (`input_output_aliases`), so in
// the model's scan over layers, with the cache donated, XLA hands the same buffers in and
// out; if it ever gives a distinct result buffer, the call first copies the cache over.
//
// Rows are copied as bytes (K * H * itemsize each), so every cache dtype works the same way.
// A slot outside [0, num_blocks * block_size) is skipped (padding tokens write block 0's
// slots, which are in range).
//
// Built on first use by pagedjax/ops/cpu_kernels.py.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteOne(const ffi::AnyBuffer& cache, const ffi::AnyBuffer& rows,
                    const int32_t* slots, int64_t layer, ffi::Result<ffi::AnyBuffer>& out) {
  auto cd = cache.dimensions();
  auto rd = rows.dimensions();
  if (cd.size() != 5 || rd.size() != 3 || rd[1] != cd[3] || rd[2] != cd[4] ||
      rows.element_type() != cache.element_type())
    return ffi::Error::InvalidArgument("kv write: shapes or dtypes disagree");
  if (layer < 0 || layer >= cd[0]) return ffi::Error::InvalidArgument("kv write: bad layer");
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
  const int64_t T = rd[0], slots_per_layer = cd[1] * cd[2];
  const int64_t row_bytes = T ? rows.size_bytes() / T : 0;
  const char* src = static_cast<const char*>(rows.untyped_data());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= slots_per_layer) continue;
    std::memcpy(dst + (layer * slots_per_layer + slot) * row_bytes, src + t * row_bytes,
                row_bytes);
  }
  return ffi::Error::Success();
}

ffi::Error KvWrite(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                   ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slot_mapping,
                   ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  if (slot_mapping.dimensions().size() != 1 || k.dimensions().size() != 3 ||
      slot_mapping.dimensions()[0] != k.dimensions()[0])
    return ffi::Error::InvalidArgument("kv write: slot_mapping and k disagree");
  const int64_t l = layer.typed_data()[0];
  const int32_t* slots = slot_mapping.typed_data();
  ffi::Error e = WriteOne(k_cache, k, slots, l, k_out);
  if (e.failure()) return e;
  return WriteOne(v_cache, v, slots, l, v_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvWriteCpu, KvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // k_cache [L, NB, BS, K, H]
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::AnyBuffer>()         // k [T, K, H], cache dtype
                                  .Arg<ffi::AnyBuffer>()         // v [T, K, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Ret<ffi::AnyBuffer>()         // k_cache, aliased
                                  .Ret<ffi::AnyBuffer>());       // v_cache, aliased
