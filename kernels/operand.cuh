// Device side of the operand precisions (kernels/fused_mlp.h's Precision):
// the storage type of a packed operand and the rounding that makes one from
// an fp32 value, shared by the fused passes and the optimizer stage that
// writes the packed copies.
#pragma once

#include <cuda_bf16.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "kernels/fused_mlp.h"

namespace qstream::kernels {

template <int P>
using Elem = std::conditional_t<P == int(Precision::kBf16), __nv_bfloat16, float>;

template <int P>
__device__ __forceinline__ Elem<P> Round(float v) {
  if constexpr (P == int(Precision::kBf16)) {
    return __float2bfloat16_rn(v);
  } else if constexpr (P == int(Precision::kTf32)) {
    return nvcuda::wmma::__float_to_tf32(v);
  } else {
    return v;
  }
}

// dst[at] = v as a packed copy stores it: rounded to the operand type, or
// fp32 as is (to_f32: the biases).
template <int P>
__device__ __forceinline__ void StorePacked(void* dst, bool to_f32, int64_t at, float v) {
  if (to_f32) {
    static_cast<float*>(dst)[at] = v;
  } else {
    static_cast<Elem<P>*>(dst)[at] = Round<P>(v);
  }
}

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

}  // namespace qstream::kernels
