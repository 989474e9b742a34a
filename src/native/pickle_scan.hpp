// The snapshot scanner: one pass over a memory snapshot pickle's opcodes (memlens._scan).
//
// scan_pickle() runs the opcodes of a pickle the way CPython's C unpickler does, but into a compact
// arena of values (16 bytes each, string bytes copied into the arena's text pool) instead of Python
// objects, and only for the opcodes a memory snapshot uses. The input is a buffer in memory or a file
// read a window at a time (a megabyte, more only for a longer opcode): a 1 GB snapshot is never held
// whole. Anything else -- every opcode the Python vetting in
// memlens/snapshot/scan.py refuses (globals, sets, DUP, LONG4, ...), the limits it enforces (tuple
// contents, large-integer and wide-tuple counts, memo indices past the bytes read), a truncated or
// malformed stream, protocol 0 text opcodes -- ends the scan with a reason: the caller then reads
// the file on the Python path, whose one-line error (or answer) is the reference. The scanner never
// gives a different answer; it gives the same one faster, or declines.
//
// The trace entries are read into columns as they are appended to their list (a plain entry --
// a dict met once, fields of the types PyTorch writes, within the reader's bounds -- becomes a row
// of its list's columns, its dict's container goes back to be reused and the list keeps only its
// first entry: the arena never holds the millions of entry dicts), and extract_traces() hands over the columns of each device_traces[d] list that is
// all such rows (memlens.snapshot.reader._parse_native_trace finishes them). A file that would
// need a dropped entry as a dict after all (met again through the memo, under another key, a list
// of entries that turns out not plain after its first rows) is declined. Every access to the input
// is checked against its length (Reader::need), every container access is at() or explicitly bounded.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "scan_limits.hpp"

namespace memlens::scan {

// Repeat: a trace entry read as a row met again through the memo (num: the columns of the list whose
// kept first entry it is, or -1 for a row since dropped); never converted to Python.
enum class Kind : uint8_t { None, Bool, Int, UInt64, Float, Str, List, Dict, Tuple, Repeat };

// One value: scalars inline; strings and containers by index into the arena's tables.
struct Value {
  Value() = default;
  Value(Kind kind_, int64_t num_) : kind(kind_), num(num_) {}
  Kind kind = Kind::None;
  int64_t num = 0;  // Bool/Int: the value; UInt64: the bits (> INT64_MAX); else an index (Float: into floats)
};

// The entry fields the columns read, by key string (None: any other string).
enum class Field : uint8_t { None, Action, Addr, Size, Stream, TimeUs, Frames, DeviceFree, UserMetadata, CompileContext };

// The interning table that last gave an arena string or container an id, and that id: rows
// meet the same memoised objects over and over, and the object is at hand where a hash table's
// slot would be a cache miss.
struct Interned {
  int32_t table = -1;
  int32_t id = -1;
};

struct StrRef {
  const uint8_t* bytes = nullptr;  // in the arena's text pool (never moved once written)
  size_t length = 0;
  Interned interned;
  Field field = Field::None;  // classified once, when the string is read (keys come back by memo)
};

struct Container {
  std::vector<Value> items;  // a dict's keys and values alternate
  Interned interned;  // a frames list's id
  int32_t columns = -1;  // a list: its entries' columns (Arena::columns), or -1
  // Bumped each time the container is reused for another object: a memo slot remembers the
  // generation it was put with, so a memo GET of a dropped entry finds it gone, never its successor.
  uint32_t generation = 0;
  Kind kind = Kind::List;
  uint8_t refs = 0;  // times pushed: creation and each memo GET (saturating; only 1 or more matters)
  bool row = false;  // a dict read as a row of its list's columns
  bool dropped = false;  // a list of rows that keeps only its first entry (the rest are columns)
  int32_t first_of = -1;  // a row kept whole: the columns of the list it is the first entry of
};

// The bytes of the strings the arena holds, in blocks that never move (a string_view into the pool
// stays valid while the pool lives, as the interning tables need), and never more than the strings.
class TextPool {
 public:
  const uint8_t* add(const uint8_t* bytes, size_t length);
  size_t size() const { return stored_; }

 private:
  static constexpr size_t kBlock = size_t{1} << 16;
  std::vector<std::unique_ptr<uint8_t[]>> blocks_;  // filled in turn
  std::vector<std::unique_ptr<uint8_t[]>> long_;  // a string over a quarter block gets its own
  size_t room_ = 0;  // bytes free at the end of the last block
  size_t stored_ = 0;
};

// A column that costs nothing while every row holds its first value (streams, OOM free bytes,
// metadata ids and, in old files, times often do): the values are written out only from the first
// row that differs.
template <typename T>
struct LazyColumn {
  size_t rows = 0;
  T first{};
  std::vector<T> values;  // empty while constant
  size_t reserve_rows = 0;  // room to take when it stops being constant

  bool constant() const { return values.empty(); }
  void push(T value) {
    if (values.empty()) {
      if (rows == 0) {
        first = value;
      } else if (value != first) {
        values.reserve(std::max(reserve_rows, rows + 1));
        values.assign(rows, first);
        values.push_back(value);
      }
    } else {
      values.push_back(value);
    }
    ++rows;
  }
  T at(size_t row) const { return values.empty() ? first : values.at(row); }
};

// The limits of the Python path (kMaxTupleItems, kMaxLargeInts, kMaxWideTuples, kMaxDevices,
// kPlausibleBytes) and the reads' size (kScanChunk) are declared once in memlens/snapshot/limits.py; CMake (and the fuzz harness's
// script) writes scan_limits.hpp from it (src/native/generate_constants.py).
// A memo index may run this far past the memo's length before the scanner declines (CPython's memo
// is sparse-tolerant; the arena's is a vector, so a far index would cost its size in memory).
inline constexpr uint64_t kMaxMemoGap = 1u << 20;
// Lists read as columns: as many as devices are read (more go as plain dicts, the Python way).
inline constexpr size_t kMaxColumnLists = static_cast<size_t>(kMaxDevices);
// The first lists' columns are reserved from the rest of the input's size (each reservation is
// about that size again in address space, untouched; more lists would reserve too much of it).
inline constexpr size_t kReservedColumnLists = 2;

// A device's trace as columns. Local indices point into the distinct tables, in order of first
// appearance (the order the Python reader meets them, so interning gives the same ids).
// Most distinct action strings a list read as columns may hold (PyTorch writes nine): the action
// column is one byte a row; a list with more is read the Python way.
inline constexpr size_t kMaxActions = 255;

struct TraceColumns {
  size_t list = 0;  // the list's container
  size_t device = 0;
  size_t rows = 0;
  bool has_time = false;
  std::vector<uint8_t> action_local;
  std::vector<Value> actions;  // distinct action strings (by content)
  std::vector<int64_t> addr, size;
  LazyColumn<int64_t> stream, time_us, device_free;
  std::vector<int32_t> frames_local;
  std::vector<Value> frames;  // distinct frames values (by identity): None or a list
  bool has_user_metadata = false, has_compile_context = false;
  LazyColumn<int32_t> metadata_local, context_local;
  std::vector<Value> metadata, context;  // distinct strings (by content) or None
  Value first_entry;  // for the format guess
  std::vector<uint8_t> action_is_oom;  // per distinct action
  // Entries appended again through the memo (Kind::Repeat): the file is refused if they all come from
  // device traces (the Python path's answer for such a file); the columns of each kept first entry met.
  bool repeats = false;
  std::vector<int32_t> repeat_origins;
};

struct Arena {
  TextPool text_pool;  // the strings' bytes (the input is not kept: it may be read a window at a time)
  std::vector<StrRef> strings;
  // Each BINFLOAT's bits, one per opcode: a float is an object, and one met again through the memo
  // must stay that object (a NaN dict key used twice is one key to CPython, as it finds it by identity).
  std::vector<uint64_t> floats;
  std::vector<Container> containers;
  std::vector<TraceColumns> columns;  // of the lists whose entries are rows (at most kMaxColumnLists)
  Value root;

  // The string's bytes.
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

// Reads up to `length` bytes of the input at `offset` into `into`: how many it read (0: none left,
// the input ended early). It may be called from a thread that holds no Python state.
using ReadAt = std::function<size_t(uint64_t offset, uint8_t* into, size_t length)>;

// Runs the pickle in the `size` bytes `read` serves, holding a window of `chunk` bytes at a time
// (more only while one opcode needs more). An input that ends before `size` bytes is "truncated".
ScanResult scan_pickle(ReadAt read, size_t size, size_t chunk = size_t{1} << 20);

struct Extraction {
  bool ok = true;
  std::string reason;
  bool has_traces_list = false;  // root is a dict whose 'device_traces' is a list
  Value traces_list;
  // Set where the file holds one trace entry at two places in device_traces: the one-line refusal,
  // word for word the Python path's (memlens.snapshot.reader.REPEATED_ENTRY).
  std::string refusal;
  std::vector<TraceColumns> traces;  // the devices read as columns (others go the Python way)
};

// The plain device traces of a scanned snapshot (a root that is no dict has none); their columns
// are moved out of the arena. ok == false (reason set) where a dropped entry would be needed as a
// dict: the caller declines the file.
Extraction extract_traces(Arena& arena);

}  // namespace memlens::scan
