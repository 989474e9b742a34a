// The numpy columns the bindings take and give (memlens._native, memlens.snapshot._kernels).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "declared_constant.hpp"

namespace memlens {

using Column = nanobind::ndarray<const int64_t, nanobind::ndim<1>, nanobind::c_contig, nanobind::device::cpu>;
using Mask = nanobind::ndarray<const uint8_t, nanobind::ndim<1>, nanobind::c_contig, nanobind::device::cpu>;
using Codes = nanobind::ndarray<const int8_t, nanobind::ndim<1>, nanobind::c_contig, nanobind::device::cpu>;  // action codes
// A column written in place.
using Sizes = nanobind::ndarray<int64_t, nanobind::ndim<1>, nanobind::c_contig, nanobind::device::cpu>;
// A column of any stride: a stream column that holds one value throughout is one element with a
// zero stride (memlens.snapshot.model.constant_column), read in place rather than written out.
using StridedColumn = nanobind::ndarray<const int64_t, nanobind::ndim<1>, nanobind::device::cpu>;

// A vector handed to numpy without a copy: the array owns it from now on.
template <typename T>
nanobind::ndarray<nanobind::numpy, T, nanobind::ndim<1>> to_array(std::vector<T>&& values) {
  auto* owned = new std::vector<T>(std::move(values));
  nanobind::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nanobind::ndarray<nanobind::numpy, T, nanobind::ndim<1>>(owned->data(), {owned->size()}, owner);
}

// The constants of a generated header's table as a dict (the module's DECLARED): the values this
// extension was built with, which tests/test_layers.py holds to the Python declarations.
template <size_t N>
void add_declared(nanobind::dict& declared, const DeclaredConstant (&table)[N]) {
  for (const DeclaredConstant& constant : table) declared[constant.python_name] = constant.value;
}

}  // namespace memlens
