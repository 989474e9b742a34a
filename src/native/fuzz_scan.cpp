// libFuzzer harness for the snapshot scanner (scripts/fuzz_scanner.sh builds and runs it under
// ASan and UBSan): any input must end in a scan that succeeds or declines, never a crash, a leak,
// undefined behaviour or a hang; and what it extracts must be self-consistent.
#include <cstddef>
#include <cstdint>

#include "pickle_scan.hpp"

namespace {

void check(bool condition) {
  if (!condition) __builtin_trap();
}

// Touch every value the arena holds (strings through their checked view, containers by index).
// Each string is a distinct range of the input, so together they are at most its size.
size_t walk(const memlens::scan::Arena& arena) {
  size_t bytes = 0;
  for (const auto& ref : arena.strings) {
    check(ref.offset <= arena.size && ref.length <= arena.size - ref.offset);
    bytes += ref.length;
  }
  for (const auto& container : arena.containers) {
    for (const auto& value : container.items) {
      if (value.kind == memlens::scan::Kind::Str) check(arena.text(value).data() != nullptr);
      if (value.kind == memlens::scan::Kind::List || value.kind == memlens::scan::Kind::Dict ||
          value.kind == memlens::scan::Kind::Tuple) {
        check(static_cast<size_t>(value.num) < arena.containers.size());
      }
    }
    if (container.kind == memlens::scan::Kind::Dict) check(container.items.size() % 2 == 0);
  }
  return bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  memlens::scan::ScanResult result = memlens::scan::scan_pickle(data, size);
  if (!result.ok) {
    check(!result.reason.empty());
    return 0;
  }
  check(walk(result.arena) <= size);
  const memlens::scan::Extraction extraction = memlens::scan::extract_traces(result.arena);
  check(extraction.ok ? !extraction.reason.size() : extraction.traces.empty() && !extraction.reason.empty());
  for (const auto& trace : extraction.traces) {
    const size_t rows = trace.rows;
    check(trace.action_local.size() == rows && trace.addr.size() == rows && trace.size.size() == rows &&
          trace.stream.size() == rows && trace.time_us.size() == rows && trace.device_free.size() == rows &&
          trace.frames_local.size() == rows && rows > 0);
    check(trace.action_is_oom.size() == trace.actions.size());
    for (int32_t id : trace.action_local) check(id >= 0 && static_cast<size_t>(id) < trace.actions.size());
    for (int32_t id : trace.frames_local) check(id >= 0 && static_cast<size_t>(id) < trace.frames.size());
    if (trace.has_user_metadata) {
      check(trace.metadata_local.size() == rows);
      for (int32_t id : trace.metadata_local) check(id >= 0 && static_cast<size_t>(id) < trace.metadata.size());
    }
    if (trace.has_compile_context) {
      check(trace.context_local.size() == rows);
      for (int32_t id : trace.context_local) check(id >= 0 && static_cast<size_t>(id) < trace.context.size());
    }
  }
  return 0;
}
