// memlens._scan: the snapshot scanner (pickle_scan.hpp) for Python.
//
// scan(data) and scan_file(fd, size) -> (False, reason) when the scanner declines (the caller reads
// the file on the Python path), or (True, (raw, traces)): raw is the snapshot as plain Python
// objects, exactly what the restricted unpickler would build (memoised objects shared as the pickle
// shares them), except that each device_traces[d] read as columns is None there; traces holds those
// devices' columns (memlens.snapshot.reader._parse_native_trace turns them into a DeviceTrace). A
// column that holds one value throughout comes as (value, rows). scan_file reads the file a
// megabyte at a time through pread(), never holding it whole.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#ifdef _WIN32
#include <io.h>
#else
#include <unistd.h>
#endif

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "pickle_scan.hpp"

namespace nb = nanobind;

namespace memlens::scan {
namespace {

// Real snapshots nest about six deep; deeper structures go the Python way (which bounds them).
constexpr int kMaxDepth = 200;

struct TooDeep {};
struct Dropped {};  // an entry whose dict the scanner dropped (read as a row), needed whole after all

class Converter {
 public:
  Converter(const Arena& arena, std::unordered_set<int64_t> skipped) : arena_(arena), skipped_(std::move(skipped)) {}

  nb::object value(const Value& value, int depth = 0) {
    switch (value.kind) {
      case Kind::None: return nb::none();
      case Kind::Bool: return nb::bool_(value.num != 0);
      case Kind::Int: return nb::steal(PyLong_FromLongLong(value.num));
      case Kind::UInt64: return nb::steal(PyLong_FromUnsignedLongLong(static_cast<uint64_t>(value.num)));
      case Kind::Float: return floating(value);
      case Kind::Repeat: throw Dropped{};  // an entry met again outside a device's trace
      case Kind::Str: return text(value);
      default: return container(value, depth);
    }
  }

 private:
  nb::object text(const Value& value) {
    auto found = strings_.find(value.num);
    if (found != strings_.end()) return found->second;
    const std::string_view bytes = arena_.text(value);
    PyObject* made = PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "surrogatepass");
    if (made == nullptr) throw nb::python_error();
    nb::object object = nb::steal(made);
    strings_.emplace(value.num, object);
    return object;
  }

  // One Python float per BINFLOAT opcode, shared by every memo GET of it (as the unpickler does).
  nb::object floating(const Value& value) {
    auto found = floats_.find(value.num);
    if (found != floats_.end()) return found->second;
    const uint64_t bits = arena_.floats.at(static_cast<size_t>(value.num));
    double number = 0;
    std::memcpy(&number, &bits, sizeof number);
    nb::object object = nb::steal(PyFloat_FromDouble(number));
    floats_.emplace(value.num, object);
    return object;
  }

  nb::object container(const Value& value, int depth) {
    auto found = containers_.find(value.num);
    if (found != containers_.end()) return found->second;
    if (depth > kMaxDepth) throw TooDeep{};
    const Container& source = arena_.container(value);
    if (source.dropped) throw Dropped{};
    if (source.kind == Kind::Tuple) {  // tuples hold scalars only (the scanner's tuple rule)
      nb::object tuple = nb::steal(PyTuple_New(static_cast<Py_ssize_t>(source.items.size())));
      for (size_t k = 0; k < source.items.size(); ++k) {
        PyTuple_SET_ITEM(tuple.ptr(), static_cast<Py_ssize_t>(k), this->value(source.items.at(k), depth + 1).release().ptr());
      }
      containers_.emplace(value.num, tuple);
      return tuple;
    }
    if (source.kind == Kind::List) {
      nb::list list;
      containers_.emplace(value.num, list);  // before the items: a list may hold itself
      for (const Value& item : source.items) {
        if ((item.kind == Kind::List) && skipped_.count(item.num)) {
          list.append(nb::none());
        } else {
          list.append(this->value(item, depth + 1));
        }
      }
      return std::move(list);
    }
    nb::dict dict;
    containers_.emplace(value.num, dict);
    for (size_t k = 0; k + 1 < source.items.size(); k += 2) {
      nb::object key = this->value(source.items.at(k), depth + 1);
      nb::object item = this->value(source.items.at(k + 1), depth + 1);
      if (PyDict_SetItem(dict.ptr(), key.ptr(), item.ptr()) != 0) throw nb::python_error();
    }
    return std::move(dict);
  }

  const Arena& arena_;
  std::unordered_set<int64_t> skipped_;
  std::unordered_map<int64_t, nb::object> strings_;
  std::unordered_map<int64_t, nb::object> floats_;
  std::unordered_map<int64_t, nb::object> containers_;
};

template <typename T>
nb::object column(std::vector<T>&& values) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* pointer) noexcept { delete static_cast<std::vector<T>*>(pointer); });
  const size_t shape[1] = {owned->size()};
  return nb::cast(nb::ndarray<nb::numpy, T, nb::ndim<1>>(owned->data(), 1, shape, owner));
}

// A lazy column: its values, or (value, rows) while every row holds its first value.
template <typename T>
nb::object column(LazyColumn<T>&& lazy) {
  if (lazy.constant()) return nb::make_tuple(lazy.first, lazy.rows);
  return column(std::move(lazy.values));
}

nb::list values(Converter& converter, const std::vector<Value>& items) {
  nb::list out;
  for (const Value& item : items) out.append(converter.value(item));
  return out;
}

// The scan's answer as Python objects (see the top of this file).
nb::object to_python(ScanResult& result, Extraction& extraction) {
  if (!result.ok) return nb::make_tuple(false, result.reason);
  if (!extraction.ok) return nb::make_tuple(false, extraction.reason);
  if (!extraction.refusal.empty()) return nb::make_tuple(false, extraction.refusal);
  std::unordered_set<int64_t> skipped;
  if (extraction.has_traces_list) {
    const Container& devices = result.arena.container(extraction.traces_list);
    for (const TraceColumns& trace : extraction.traces) skipped.insert(devices.items.at(trace.device).num);
  }
  try {
    Converter converter(result.arena, std::move(skipped));
    nb::object raw = converter.value(result.arena.root);
    nb::list traces;
    for (TraceColumns& trace : extraction.traces) {
      nb::dict fields;
      fields["device"] = trace.device;
      fields["has_time"] = trace.has_time;
      fields["action_local"] = column(std::move(trace.action_local));
      fields["actions"] = values(converter, trace.actions);
      fields["address"] = column(std::move(trace.addr));
      fields["size"] = column(std::move(trace.size));
      fields["stream"] = column(std::move(trace.stream));
      fields["time_us"] = column(std::move(trace.time_us));
      fields["device_free"] = column(std::move(trace.device_free));
      fields["frames_local"] = column(std::move(trace.frames_local));
      fields["frames"] = values(converter, trace.frames);
      fields["has_user_metadata"] = trace.has_user_metadata;
      fields["metadata_local"] = column(std::move(trace.metadata_local));
      fields["metadata"] = values(converter, trace.metadata);
      fields["has_compile_context"] = trace.has_compile_context;
      fields["context_local"] = column(std::move(trace.context_local));
      fields["context"] = values(converter, trace.context);
      fields["first_entry"] = converter.value(trace.first_entry);
      traces.append(fields);
    }
    return nb::make_tuple(true, nb::make_tuple(raw, traces));
  } catch (const TooDeep&) {
    return nb::make_tuple(false, "nested too deeply");
  } catch (const Dropped&) {
    return nb::make_tuple(false, "a trace entry needed whole");
  } catch (nb::python_error& error) {
    // A value CPython would not build either (a string that is no UTF-8, an unhashable key):
    // the Python path says what.
    error.restore();
    PyErr_Clear();
    return nb::make_tuple(false, "a value Python refuses");
  }
}

nb::object scan(nb::bytes data) {
  const auto* bytes = static_cast<const uint8_t*>(data.data());
  ScanResult result;
  Extraction extraction;
  {
    nb::gil_scoped_release released;  // the opcodes and columns need no Python
    result = scan_pickle(bytes, data.size());
    if (result.ok) extraction = extract_traces(result.arena);
  }
  return to_python(result, extraction);
}

// Up to `length` bytes of the file at `offset`: 0 at its end or on an error (the scan then
// declines as truncated, and the Python path reads the file and says what is wrong).
size_t read_at(int fd, uint64_t offset, uint8_t* into, size_t length) {
  length = std::min<size_t>(length, INT_MAX);
  while (true) {
#ifdef _WIN32
    if (_lseeki64(fd, static_cast<__int64>(offset), SEEK_SET) < 0) return 0;
    const int got = _read(fd, into, static_cast<unsigned int>(length));
#else
    const ssize_t got = ::pread(fd, into, length, static_cast<off_t>(offset));
#endif
    if (got < 0 && errno == EINTR) continue;
    return got < 0 ? 0 : static_cast<size_t>(got);
  }
}

// The scan's working memory (the arena's containers, the memo, the text pool) is freed by now.
// glibc keeps what a thread frees in that thread's arena, where the rest of the process (the
// parse and the analysis, on the main thread: memlens.snapshot.ahead scans on a thread of its
// own) does not reuse it; handed back, a 4M-entry first open peaks 30 MiB lower.
void give_back_freed_memory() {
#if defined(__GLIBC__)
  nb::gil_scoped_release released;
  malloc_trim(0);
#endif
}

// A request to stop a scan, from any thread: the scan's next read finds the file at its end, and
// the scan declines as for a truncated file. A scan begun ahead that nobody will take stops so
// (memlens.snapshot.ahead), instead of running on until the process is shutting down, when its
// thread could no longer take the GIL back to hand its answer over.
struct StopFlag {
  std::atomic<bool> stop{false};
};

nb::object scan_file(int fd, uint64_t size, size_t chunk, const StopFlag* stop) {
  nb::object answer;
  {
    ScanResult result;
    Extraction extraction;
    {
      nb::gil_scoped_release released;  // the reads, opcodes and columns need no Python
      result = scan_pickle(
          [fd, stop](uint64_t offset, uint8_t* into, size_t length) -> size_t {
            if (stop != nullptr && stop->stop.load(std::memory_order_relaxed)) return 0;
            return read_at(fd, offset, into, length);
          },
          static_cast<size_t>(size), chunk);
      if (result.ok) extraction = extract_traces(result.arena);
    }
    answer = to_python(result, extraction);
  }
  give_back_freed_memory();
  return answer;
}

}  // namespace
}  // namespace memlens::scan

NB_MODULE(_scan, m) {
  m.doc() = "memlens's native snapshot scanner (see src/native/pickle_scan.hpp)";
  // The memlens program leaves what is left at its exit to the OS, uncollected (gc.freeze in
  // memlens.cli.launch): nanobind would call those objects leaks.
  nb::set_leak_warnings(false);
  // The limits this extension was built with, which tests/test_layers.py holds to
  // memlens/snapshot/limits.py (the one declaration).
  nb::dict declared;
  for (const memlens::DeclaredConstant& constant : memlens::kScanLimits) declared[constant.python_name] = constant.value;
  m.attr("DECLARED") = declared;
  nb::class_<memlens::scan::StopFlag>(m, "StopFlag", "A request to stop a scan_file: set() from any thread.")
      .def(nb::init<>())
      .def("set", [](memlens::scan::StopFlag& flag) { flag.stop.store(true, std::memory_order_relaxed); });
  m.def("scan", &memlens::scan::scan, nb::arg("data"),
        "Scan a snapshot pickle: (False, reason) when declined, else (True, (raw, traces)).");
  m.def("scan_file", &memlens::scan::scan_file, nb::arg("fd"), nb::arg("size"), nb::arg("chunk") = static_cast<size_t>(memlens::kScanChunk),
        nb::arg("stop").none() = nb::none(),
        "Scan the snapshot pickle of `size` bytes in the open file `fd` (read with pread, `chunk` "
        "bytes at a time): (False, reason) when declined, else (True, (raw, traces)). A set `stop` "
        "flag makes it decline at its next read.");
}
