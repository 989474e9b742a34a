// libFuzzer harness for the snapshot scanner (scripts/fuzz_scanner.sh builds and runs it under
// ASan and UBSan): any input must end in a scan that succeeds or declines, never a crash, a leak,
// undefined behaviour or a hang; and what it extracts must be self-consistent.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "pickle_scan.hpp"

namespace {

void check(bool condition) {
  if (!condition) __builtin_trap();
}

// Touch every value the arena holds (strings through their view, containers by index). Each
// string's bytes were copied from a distinct range of the input, so together they are at most its size.
size_t walk(const memlens::scan::Arena& arena) {
  size_t bytes = 0;
  for (const auto& ref : arena.strings) {
    check(ref.bytes != nullptr);
    bytes += ref.length;
  }
  check(bytes == arena.text_pool.size());
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

template <typename T>
bool same_column(const memlens::scan::LazyColumn<T>& a, const memlens::scan::LazyColumn<T>& b) {
  if (a.rows != b.rows || a.constant() != b.constant()) return false;
  for (size_t row = 0; row < a.rows; ++row) {
    if (a.at(row) != b.at(row)) return false;
  }
  return true;
}

template <typename T>
void check_lazy(const memlens::scan::LazyColumn<T>& column, size_t rows) {
  check(column.rows == rows && (column.constant() || column.values.size() == rows));
}

// The same input read in memory and through a window of a few bytes: the same answer, to the byte.
void check_same(const memlens::scan::ScanResult& whole, const memlens::scan::ScanResult& windowed) {
  check(whole.ok == windowed.ok && whole.reason == windowed.reason);
  if (!whole.ok) return;
  const auto& a = whole.arena;
  const auto& b = windowed.arena;
  check(a.strings.size() == b.strings.size() && a.containers.size() == b.containers.size());
  for (size_t k = 0; k < a.strings.size(); ++k) {
    const memlens::scan::Value value{memlens::scan::Kind::Str, static_cast<int64_t>(k)};
    check(a.text(value) == b.text(value));
  }
  check(a.columns.size() == b.columns.size());
  for (size_t k = 0; k < a.columns.size(); ++k) {
    const auto& x = a.columns[k];
    const auto& y = b.columns[k];
    check(x.rows == y.rows && x.addr == y.addr && x.size == y.size && x.action_local == y.action_local &&
          x.frames_local == y.frames_local && same_column(x.stream, y.stream) && same_column(x.time_us, y.time_us) &&
          same_column(x.device_free, y.device_free) && same_column(x.metadata_local, y.metadata_local) &&
          same_column(x.context_local, y.context_local));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  memlens::scan::ScanResult result = memlens::scan::scan_pickle(data, size);
  // A window of 1 to 64 bytes (from the input's first byte): every opcode straddles a refill.
  const size_t chunk = size ? 1 + data[0] % 64 : 1;
  const memlens::scan::ScanResult windowed = memlens::scan::scan_pickle(
      [data, size](uint64_t offset, uint8_t* into, size_t length) -> size_t {
        if (offset >= size) return 0;
        const size_t count = length < size - offset ? length : static_cast<size_t>(size - offset);
        std::memcpy(into, data + offset, count);
        return count;
      },
      size, chunk);
  check_same(result, windowed);
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
          trace.frames_local.size() == rows && rows > 0);
    check_lazy(trace.stream, rows);
    check_lazy(trace.time_us, rows);
    check_lazy(trace.device_free, rows);
    check(trace.action_is_oom.size() == trace.actions.size() && trace.actions.size() <= memlens::scan::kMaxActions);
    for (uint8_t id : trace.action_local) check(static_cast<size_t>(id) < trace.actions.size());
    for (int32_t id : trace.frames_local) check(id >= 0 && static_cast<size_t>(id) < trace.frames.size());
    if (trace.has_user_metadata) {
      check_lazy(trace.metadata_local, rows);
      for (size_t row = 0; row < rows; ++row) {
        const int32_t id = trace.metadata_local.at(row);
        check(id >= 0 && static_cast<size_t>(id) < trace.metadata.size());
      }
    }
    if (trace.has_compile_context) {
      check_lazy(trace.context_local, rows);
      for (size_t row = 0; row < rows; ++row) {
        const int32_t id = trace.context_local.at(row);
        check(id >= 0 && static_cast<size_t>(id) < trace.context.size());
      }
    }
  }
  return 0;
}
