// One entry of a generated header's table (src/native/generate_constants.py): a constant's Python
// name and its value, which the bindings export as DECLARED for the test that holds the built
// extension to the Python declaration (tests/test_layers.py).
#pragma once
#include <cstdint>

namespace memlens {
struct DeclaredConstant {
  const char* python_name;
  int64_t value;
};
}  // namespace memlens
