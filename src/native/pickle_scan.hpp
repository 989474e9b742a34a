// The snapshot scanner: one pass over a memory snapshot pickle's opcodes (memlens._scan).
//
// scan_pickle() runs the opcodes of a pickle the way CPython's C unpickler does, but into a compact
// arena of values (16 bytes each, strings left in the input buffer) instead of Python objects, and
// only for the opcodes a memory snapshot uses. Anything else -- every opcode the Python vetting in
// memlens/snapshot/scan.py refuses (globals, sets, DUP, LONG4, ...), the limits it enforces (tuple
// contents, large-integer and wide-tuple counts, memo indices past the bytes read), a truncated or
// malformed stream, protocol 0 text opcodes -- ends the scan with a reason: the caller then reads
// the file on the Python path, whose one-line error (or answer) is the reference. The scanner never
// gives a different answer; it gives the same one faster, or declines.
//
// extract_traces() then turns each device_traces[d] list whose entries are plain (dicts met once,
// fields of the types PyTorch writes, within the reader's bounds) into columns and interning tables
// (memlens.snapshot.reader._parse_native_trace finishes them). Every access to the input is checked
// against its length (Reader::need), every container access is at() or explicitly bounded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace memlens::scan {

enum class Kind : uint8_t { None, Bool, Int, UInt64, Float, Str, List, Dict, Tuple };

// One value: scalars inline; strings and containers by index into the arena's tables.
struct Value {
  Kind kind = Kind::None;
  int64_t num = 0;  // Bool/Int: the value; UInt64: the bits (> INT64_MAX); Float: the bits; else an index
};

struct StrRef {
  size_t offset = 0;  // into the input buffer
  size_t length = 0;
};

struct Container {
  Kind kind = Kind::List;
  uint32_t refs = 0;  // times pushed: creation and each memo GET (saturating)
  std::vector<Value> items;  // a dict's keys and values alternate
};

// Limits of the Python vetting (memlens/snapshot/scan.py): the same numbers.
inline constexpr int kMaxTupleItems = 8;
inline constexpr int64_t kMaxLargeInts = 10'000;
inline constexpr int64_t kMaxWideTuples = 10'000;
// A memo index may run this far past the memo's length before the scanner declines (CPython's memo
// is sparse-tolerant; the arena's is a vector, so a far index would cost its size in memory).
inline constexpr uint64_t kMaxMemoGap = 1u << 20;
inline constexpr size_t kMaxDevices = 1024;  // memlens.snapshot.validate.MAX_DEVICES
inline constexpr int64_t kPlausibleBytes = int64_t{1} << 44;  // validate.PLAUSIBLE_BYTES

struct Arena {
  const uint8_t* data = nullptr;  // the input; not owned, must outlive the arena
  size_t size = 0;
  std::vector<StrRef> strings;
  std::vector<Container> containers;
  Value root;

  // The string's bytes, checked against the input's length.
  std::string_view text(const Value& value) const;
  const Container& container(const Value& value) const { return containers.at(static_cast<size_t>(value.num)); }
};

struct ScanResult {
  bool ok = false;
  std::string reason;  // why the scanner declined (the Python path then reads the file)
  Arena arena;
};

// Runs the pickle in data[0, size). ok == false: declined, with the reason.
ScanResult scan_pickle(const uint8_t* data, size_t size);

// A device's trace as columns. Local indices point into the distinct tables, in order of first
// appearance (the order the Python reader meets them, so interning gives the same ids).
struct TraceColumns {
  size_t device = 0;
  size_t rows = 0;
  bool has_time = false;
  std::vector<int32_t> action_local;
  std::vector<Value> actions;  // distinct action strings (by content)
  std::vector<int64_t> addr, size, stream, time_us, device_free;
  std::vector<int32_t> frames_local;
  std::vector<Value> frames;  // distinct frames values (by identity): None or a list
  bool has_user_metadata = false, has_compile_context = false;
  std::vector<int32_t> metadata_local, context_local;
  std::vector<Value> metadata, context;  // distinct strings (by content) or None
  Value first_entry;  // for the format guess
};

struct Extraction {
  bool has_traces_list = false;  // root is a dict whose 'device_traces' is a list
  Value traces_list;
  std::vector<TraceColumns> traces;  // the devices read as columns (others go the Python way)
};

// The plain device traces of a scanned snapshot (a root that is no dict has none).
Extraction extract_traces(const Arena& arena);

}  // namespace memlens::scan
