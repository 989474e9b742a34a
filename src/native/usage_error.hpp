// A usage error: memlens.errors.MemlensUsageError on the Python side (both extensions translate
// it), its message as the Python reference's.
#pragma once
#include <stdexcept>

namespace memlens {
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
}  // namespace memlens
