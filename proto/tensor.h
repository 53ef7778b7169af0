// Building and reading the raw-bytes columns (v1::Tensor) of a
// TransitionBatch: little-endian, row-major, product(shape) elements of the
// tensor's dtype. Header-only and proto-only, so clients, tests and the
// benchmark share it without linking the daemon.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "qstream/v1/experience.pb.h"

namespace qstream::wire {

static_assert(std::endian::native == std::endian::little, "the wire tensors are little-endian");

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr v1::Tensor::DType kValue = v1::Tensor::DTYPE_FLOAT32;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr v1::Tensor::DType kValue = v1::Tensor::DTYPE_INT32;
};
template <>
struct DTypeOf<uint32_t> {
  static constexpr v1::Tensor::DType kValue = v1::Tensor::DTYPE_UINT32;
};
// DTYPE_BOOL: one byte per element, 0 or 1.
template <>
struct DTypeOf<uint8_t> {
  static constexpr v1::Tensor::DType kValue = v1::Tensor::DTYPE_BOOL;
};

// Bytes per element of `dtype` (0 for DTYPE_UNSPECIFIED or an unknown value).
inline int64_t ItemSize(v1::Tensor::DType dtype) {
  switch (dtype) {
    case v1::Tensor::DTYPE_FLOAT32:
    case v1::Tensor::DTYPE_INT32:
    case v1::Tensor::DTYPE_UINT32: return 4;
    case v1::Tensor::DTYPE_BOOL: return 1;
    default: return 0;
  }
}

// Sets `t` to `n` elements at `x` with `shape` (whose product the caller
// keeps equal to n): one copy of the bytes.
template <typename T>
void SetTensor(v1::Tensor* t, const T* x, int64_t n, std::initializer_list<int64_t> shape) {
  t->set_dtype(DTypeOf<T>::kValue);
  t->clear_shape();
  for (int64_t d : shape) t->add_shape(d);
  t->mutable_data()->assign(reinterpret_cast<const char*>(x), static_cast<size_t>(n) * sizeof(T));
}

template <typename T>
void SetTensor(v1::Tensor* t, const std::vector<T>& x, std::initializer_list<int64_t> shape) {
  SetTensor(t, x.data(), static_cast<int64_t>(x.size()), shape);
}

// Flags (done, truncated) from bools, one byte each.
inline void SetBoolTensor(v1::Tensor* t, const std::vector<bool>& x) {
  std::vector<uint8_t> bytes(x.begin(), x.end());
  SetTensor(t, bytes, {static_cast<int64_t>(x.size())});
}

// Overwrites element i of `t` as a T (for tools and tests that edit one
// value); the data must hold it.
template <typename T>
void SetElement(v1::Tensor* t, int64_t i, T value) {
  std::memcpy(t->mutable_data()->data() + i * static_cast<int64_t>(sizeof(T)), &value, sizeof(T));
}

// The elements of `t` read as T (whatever its dtype says; the bytes that do
// not fill a whole element are ignored).
template <typename T>
std::vector<T> Values(const v1::Tensor& t) {
  std::vector<T> out(t.data().size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), t.data().data(), out.size() * sizeof(T));
  return out;
}

}  // namespace qstream::wire
