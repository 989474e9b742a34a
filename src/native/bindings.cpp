// memlens._native: the caching-allocator model (caching_allocator.hpp) for Python, and the what-if
// replay loop over a trace's columns (memlens.allocator.replay._Replay.run, event for event). The
// snapshot's own passes (block sizes, lifetimes, curves) are memlens.snapshot._kernels
// (snapshot_kernels.cpp).
//
// Python subclasses ``Simulator`` (memlens.allocator.native.NativeCachingAllocatorSimulator) to
// give it the reference model's constructor and attributes; errors leave as the reference model's
// exceptions: MemlensUsageError, and SimulatedOOM with its five figures.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>

#include "actions.hpp"
#include "caching_allocator.hpp"
#include "columns.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace memlens {
namespace {

class Simulator {
 public:
  Simulator(std::optional<int64_t> max_split_size, std::vector<int64_t> divisions, bool expandable_segments,
            std::optional<int64_t> capacity, std::optional<int64_t> allowed, int64_t gc_threshold_bytes,
            bool gc_enabled, bool record_history, nb::object clock, nb::object segment_addresses, nb::list trace,
            int64_t device)
      : core_(Settings{max_split_size, std::move(divisions), expandable_segments, capacity, allowed,
                       gc_threshold_bytes, gc_enabled}),
        clock_(std::move(clock)),
        trace_(std::move(trace)),
        device_(device) {
    core_.record_history = record_history;
    core_.recorder = [this](Action action, std::optional<int64_t> address, int64_t size, int64_t stream,
                            const Frames& frames, int64_t device_free) {
      record(action, address, size, stream, frames, device_free);
    };
    if (!segment_addresses.is_none()) {
      python_segment_addresses_ = std::move(segment_addresses);
      core_.segment_addresses = [this](int64_t size) -> std::optional<int64_t> {
        nb::object hinted = python_segment_addresses_(size);
        if (hinted.is_none()) return std::nullopt;
        return nb::cast<int64_t>(hinted);
      };
    }
  }

  CachingAllocator& core() { return core_; }

  // A frames argument as given: None and an omitted one are both "no frames" (Python's falsy
  // None). A simulator once given frames holds Python objects from then on.
  Frames frames_of(const nb::handle& frames) {
    if (frames.is_none()) return Frames();
    held_frames_ = true;
    return nb::borrow(frames);
  }

  // Whether its allocator model touches no Python object as it runs: it holds no frames and
  // records no trace entries (so a replay may run without the GIL).
  bool python_free() const { return !held_frames_ && !core_.record_history; }

  // The trace entry the Python model's ``_record`` appends, key for key.
  void record(Action action, std::optional<int64_t> address, int64_t size, int64_t stream, const Frames& frames,
              int64_t device_free) {
    nb::dict entry;
    entry["action"] = action_name(action);
    if (address) {
      entry["addr"] = *address;
    } else {
      entry["device_free"] = device_free;
    }
    entry["size"] = size;
    entry["stream"] = stream;
    if (clock_.is_none()) {
      entry["time_us"] = next_time_us_++;
    } else {
      entry["time_us"] = clock_();
    }
    nb::list frame_list;
    if (frames.is_valid()) {
      int truth = PyObject_IsTrue(frames.ptr());
      if (truth < 0) throw nb::python_error();
      if (truth) frame_list = nb::list(frames);
    }
    entry["frames"] = frame_list;
    trace_.append(entry);
  }

  nb::list segments() const {
    nb::list result;
    for (const Block* head : core_.segment_heads()) {
      nb::list blocks;
      int64_t total = 0, allocated = 0, active = 0, requested = 0;
      const Block* block = head;
      while (block != nullptr && block->mapped) {
        const char* state = block->allocated ? "active_allocated" : block->pending ? "active_pending_free" : "inactive";
        nb::dict item;
        item["address"] = block->address;
        item["size"] = block->size;
        item["requested_size"] = block->requested_size;
        item["state"] = state;
        item["frames"] = block->frames.is_valid() && !block->frames.is_none() && PyObject_IsTrue(block->frames.ptr())
                             ? nb::list(block->frames)
                             : nb::list();
        blocks.append(item);
        total += block->size;
        if (block->allocated) allocated += block->size;
        if (block->allocated || block->pending) {
          active += block->size;
          requested += block->requested_size;
        }
        block = block->next;
      }
      nb::dict segment;
      segment["device"] = device_;
      segment["address"] = head->address;
      segment["total_size"] = total;
      segment["allocated_size"] = allocated;
      segment["active_size"] = active;
      segment["requested_size"] = requested;
      segment["stream"] = head->stream;
      segment["segment_type"] = head->is_small ? "small" : "large";
      segment["segment_pool_id"] = nb::make_tuple(0, 0);
      segment["is_expandable"] = head->expandable != nullptr;
      const Frames& frames = head->segment_frames;
      segment["frames"] =
          frames.is_valid() && !frames.is_none() && PyObject_IsTrue(frames.ptr()) ? nb::list(frames) : nb::list();
      segment["blocks"] = blocks;
      result.append(segment);
    }
    return result;
  }

  std::vector<std::tuple<int64_t, int64_t, std::string>> blocks() const {
    std::vector<std::tuple<int64_t, int64_t, std::string>> result;
    for (const Block* head : core_.segment_heads()) {
      for (const Block* block = head; block != nullptr && block->mapped; block = block->next) {
        result.emplace_back(block->address, block->size,
                            block->allocated ? "active_allocated" : block->pending ? "active_pending_free" : "inactive");
      }
    }
    return result;
  }

 private:
  CachingAllocator core_;
  nb::object clock_;
  nb::object python_segment_addresses_;
  nb::list trace_;
  int64_t device_;
  int64_t next_time_us_ = kDefaultStartTimeUs;
  bool held_frames_ = false;
};

// ------------------------------------------------------------------ the what-if replay loop
// The action codes (kAlloc, ...) are memlens.snapshot.model.Action's, through actions.hpp.

// The recorded segment_allocs not yet paired, in order; pairing takes one of the first eight.
class AddressHints {
 public:
  AddressHints(const int64_t* addresses, const int64_t* sizes, size_t count)
      : addresses_(addresses), sizes_(sizes), taken_(count, false), count_(count) {}

  // (recorded address) of the first of the next few hints of ``size``, taken out of the list.
  std::optional<int64_t> take(int64_t size) {
    int live = 0;
    for (size_t i = head_; i < count_ && live < kAddressHintLookahead; ++i) {
      if (taken_[i]) continue;
      ++live;
      if (sizes_[i] == size) {
        taken_[i] = true;
        while (head_ < count_ && taken_[head_]) ++head_;
        return addresses_[i];
      }
    }
    return std::nullopt;
  }

 private:
  const int64_t* addresses_;
  const int64_t* sizes_;
  std::vector<bool> taken_;
  size_t count_;
  size_t head_ = 0;
};

// _RecordedSegments: the recorded run's live segments as the window goes (segment start -> size).
using RecordedSegments = RangeMap;

// Restores the simulator's segment-address hook however the replay leaves (an observer may raise).
struct HookGuard {
  CachingAllocator& core;
  SegmentAddresses saved;
  explicit HookGuard(CachingAllocator& c) : core(c), saved(c.segment_addresses) {}
  ~HookGuard() { core.segment_addresses = saved; }
};

// What a watched replay (memlens.allocator.replay.Watch) notes as it goes, with no Python call:
// the reserved bytes at every segment_alloc and oom row it replays, where an observer would be
// called, and at the watched ones among them the cached summary of one pool on one stream.
struct Watching {
  const int64_t* rows = nullptr;  // ascending, each a segment_alloc or oom row
  const uint8_t* small = nullptr;
  const int64_t* streams = nullptr;
  const uint8_t* pieces_only = nullptr;
  size_t count = 0;
  int64_t stop_after = -1;  // stop once a noted row is at or after it (-1: never)
  size_t next = 0;
  std::vector<int64_t> noted_rows, noted_reserved;
  std::vector<int64_t> summaries;  // four a watched row: total, whole, largest, count (-1: not reached)
  bool stopped = false;

  // Notes row ``i``; whether the replay stops there.
  bool note(size_t i, const CachingAllocator& sim) {
    const auto row = static_cast<int64_t>(i);
    noted_rows.push_back(row);
    noted_reserved.push_back(sim.reserved_bytes);
    while (next < count && rows[next] < row) ++next;
    if (next < count && rows[next] == row) {
      const auto [total, whole, largest, blocks] = sim.cached_summary(small[next] != 0, streams[next], pieces_only[next] != 0);
      int64_t* summary = summaries.data() + 4 * next;
      summary[0] = total;
      summary[1] = whole;
      summary[2] = largest;
      summary[3] = blocks;
      ++next;
    }
    stopped = stop_after >= 0 && row >= stop_after;
    return stopped;
  }
};

// _Replay.run's loop: the same decisions in the same order; returns the raw figures. A replay
// with no observer whose simulator holds no Python object runs without the GIL.
nb::dict replay(nb::object simulator, Codes actions_in, Column addresses_in, Column sizes_in, StridedColumn streams_in,
                Mask completes_in, Mask empty_cache_in, Column hint_addresses, Column hint_sizes,
                bool use_recorded_addresses, std::vector<int64_t> seeded_live,
                std::vector<std::pair<int64_t, int64_t>> recorded_initial, bool over_capacity, nb::object observer,
                std::optional<std::tuple<Column, Mask, Column, Mask, int64_t>> watch) {
  Simulator& sim_object = nb::cast<Simulator&>(simulator);
  CachingAllocator& sim = sim_object.core();
  const size_t n = actions_in.shape(0);
  if (addresses_in.shape(0) != n || sizes_in.shape(0) != n || streams_in.shape(0) != n ||
      completes_in.shape(0) != n || empty_cache_in.shape(0) != n || hint_addresses.shape(0) != hint_sizes.shape(0)) {
    throw UsageError("replay columns differ in length");
  }
  std::optional<Watching> watching;
  if (watch) {
    const auto& [rows, small, streams, pieces_only, stop_after] = *watch;
    const size_t count = rows.shape(0);
    if (small.shape(0) != count || streams.shape(0) != count || pieces_only.shape(0) != count) {
      throw UsageError("watch columns differ in length");
    }
    for (size_t k = 1; k < count; ++k) {
      if (rows.data()[k] <= rows.data()[k - 1]) throw UsageError("watched rows are not ascending");
    }
    watching.emplace();
    watching->rows = rows.data();
    watching->small = small.data();
    watching->streams = streams.data();
    watching->pieces_only = pieces_only.data();
    watching->count = count;
    watching->stop_after = stop_after;
    watching->summaries.assign(4 * count, -1);
  }
  const int8_t* actions = actions_in.data();
  const int64_t* addresses = addresses_in.data();
  const int64_t* sizes = sizes_in.data();
  const int64_t* stream_data = streams_in.data();
  const int64_t stream_stride = streams_in.stride(0);
  auto stream_of = [&](size_t row) { return stream_data[static_cast<int64_t>(row) * stream_stride]; };
  const uint8_t* completes = completes_in.data();
  const uint8_t* empty_cache_at = empty_cache_in.data();
  const bool observing = !observer.is_none();

  AddressHints hints(hint_addresses.data(), hint_sizes.data(), hint_addresses.shape(0));
  std::optional<int64_t> pending_pair;
  AddressMap<int64_t> paired;  // simulated segment base -> recorded segment base
  HookGuard guard(sim);
  sim.segment_addresses = [&](int64_t size) -> std::optional<int64_t> {
    pending_pair.reset();
    std::optional<int64_t> address = hints.take(size);
    if (!address) return std::nullopt;
    pending_pair = address;
    return use_recorded_addresses ? address : std::nullopt;
  };
  auto settle_pair = [&](int64_t sim_address) {
    if (!pending_pair) return;
    std::optional<int64_t> base = sim.segment_base(sim_address);
    if (base) paired.set(*base, *pending_pair);
    pending_pair.reset();
  };

  RecordedSegments recorded_segments;
  for (const auto& [address, size] : recorded_initial) recorded_segments.set(address, size);
  AddressMap<int64_t> mapping;  // recorded address -> simulated address of the live blocks
  for (int64_t address : seeded_live) mapping.set(address, address);

  const Frames none;
  int64_t peak_reserved = sim.reserved_bytes;
  int64_t peak_event = -1;
  int64_t fragmentation = sim.reserved_bytes - sim.allocated_bytes;
  int64_t peak_allocated = sim.allocated_bytes;
  std::optional<int64_t> oom_event, oom_size;
  if (over_capacity) oom_event = 0;
  int64_t matches = 0, allocs = 0, placed = 0, same_place = 0;
  std::vector<int64_t> fits;  // rows of recorded OOMs whose request fits in the simulation

  std::optional<nb::gil_scoped_release> released;
  if (!observing && sim_object.python_free()) released.emplace();  // the loop below needs no Python
  for (size_t i = 0; i < (over_capacity ? 0 : n); ++i) {
    const int64_t act = actions[i];
    if (act == kAlloc) {
      const int64_t address = addresses[i];
      int64_t sim_address;
      try {
        sim_address = sim.malloc(sizes[i], stream_of(i), none);
      } catch (const OutOfMemory&) {
        oom_event = static_cast<int64_t>(i);
        oom_size = sizes[i];
        break;
      }
      settle_pair(sim_address);
      mapping.set(address, sim_address);
      allocs += 1;
      std::optional<int64_t> recorded_base = recorded_segments.start_of(address);
      if (recorded_base) {
        placed += 1;
        if (sim_address == address) {
          matches += 1;
          same_place += 1;
        } else {
          std::optional<int64_t> sim_base = sim.segment_base(sim_address);
          if (sim_base) {
            const int64_t* pair = paired.find(*sim_base);
            int64_t stands_for = pair != nullptr ? *pair : *sim_base;
            if (stands_for == *recorded_base && sim_address - *sim_base == address - *recorded_base) same_place += 1;
          }
        }
      } else {
        matches += sim_address == address;
      }
      if (sim.allocated_bytes > peak_allocated) peak_allocated = sim.allocated_bytes;
      const int64_t reserved = sim.reserved_bytes;
      if (reserved >= peak_reserved) {
        const int64_t waste = reserved - sim.allocated_bytes;
        if (reserved > peak_reserved || waste < fragmentation) {
          peak_reserved = reserved;
          peak_event = static_cast<int64_t>(i);
          fragmentation = waste;
        }
      }
    } else if (act == kFreeRequested) {
      const int64_t* found = mapping.find(addresses[i]);
      if (found != nullptr && *found >= 0 && sim.is_allocated(*found)) {
        if (completes[i]) {
          sim.request_free(*found, none);
        } else {
          sim.free(*found, none);
          mapping.erase(addresses[i]);
        }
      }
    } else if (act == kFreeCompleted) {
      const int64_t* found = mapping.find(addresses[i]);
      if (found != nullptr) {
        const int64_t sim_address = *found;
        mapping.erase(addresses[i]);
        if (sim_address >= 0 && sim.is_allocated(sim_address)) sim.complete_free(sim_address, none);
      }
    } else if (act == kSegmentAlloc) {
      recorded_segments.set(addresses[i], sizes[i]);
      if (observing) observer(i, simulator);
      if (watching && watching->note(i, sim)) break;
    } else if (act == kSegmentFree) {
      recorded_segments.erase(addresses[i]);
      if (empty_cache_at[i]) sim.empty_cache(none);
    } else if (act == kSegmentUnmap) {
      if (empty_cache_at[i]) sim.empty_cache(none);
    } else if (act == kOom) {
      if (observing) observer(i, simulator);
      if (watching && watching->note(i, sim)) break;
      // The request that failed in the recorded run is not an alloc row: try it here.
      int64_t trial;
      try {
        trial = sim.malloc(sizes[i], stream_of(i), none);
      } catch (const OutOfMemory&) {
        oom_event = static_cast<int64_t>(i);
        oom_size = sizes[i];
        break;
      }
      settle_pair(trial);
      fits.push_back(static_cast<int64_t>(i));
      sim.free(trial, none);  // the recorded program never got it: keep the rest of the replay aligned
    }
  }
  released.reset();
  nb::dict figures;
  figures["events"] = oom_event ? *oom_event : static_cast<int64_t>(n);
  figures["peak_reserved_bytes"] = peak_reserved;
  figures["peak_allocated_bytes"] = peak_allocated;
  figures["fragmentation_at_peak_bytes"] = fragmentation;
  figures["peak_event"] = peak_event;
  figures["final_reserved_bytes"] = sim.reserved_bytes;
  figures["oom_event"] = oom_event;
  figures["oom_size_bytes"] = oom_size;
  figures["matches"] = matches;
  figures["allocs"] = allocs;
  figures["placed"] = placed;
  figures["same_place"] = same_place;
  nb::list fit_rows;
  for (int64_t row : fits) fit_rows.append(row);
  figures["fits"] = fit_rows;
  if (watching) {
    figures["noted_rows"] = to_array(std::move(watching->noted_rows));
    figures["noted_reserved"] = to_array(std::move(watching->noted_reserved));
    figures["summaries"] = to_array(std::move(watching->summaries));
    figures["stopped"] = watching->stopped;
  }
  return figures;
}

// _Replay._completed_requests: the free_requested rows a later free_completed finishes.
nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> completed_requests(Codes actions_in, Column addresses_in) {
  const size_t n = actions_in.shape(0);
  if (addresses_in.shape(0) != n) throw UsageError("replay columns differ in length");
  const int8_t* actions = actions_in.data();
  const int64_t* addresses = addresses_in.data();
  auto* mask = new uint8_t[n == 0 ? 1 : n]();
  nb::capsule owner(mask, [](void* p) noexcept { delete[] static_cast<uint8_t*>(p); });
  AddressMap<size_t> last_request;
  for (size_t i = 0; i < n; ++i) {
    if (actions[i] == kFreeRequested) {
      last_request.set(addresses[i], i);
    } else if (actions[i] == kFreeCompleted) {
      const size_t* found = last_request.find(addresses[i]);
      if (found != nullptr) {
        mask[*found] = 1;
        last_request.erase(addresses[i]);
      }
    } else if (actions[i] == kAlloc) {
      last_request.erase(addresses[i]);
    }
  }
  return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(mask, {n}, owner);
}

// memlens.allocator.initial_state: each address's first block event (an alloc, free_requested or
// free_completed row), in the order the addresses first appear: (the addresses, their rows). One
// pass over a hash map; numpy's stable unique sorted the whole column (1 s of a 4M-row triage).
nb::tuple first_block_events(Codes actions_in, Column addresses_in) {
  const size_t n = actions_in.shape(0);
  if (addresses_in.shape(0) != n) throw UsageError("initial state columns differ in length");
  const int8_t* actions = actions_in.data();
  const int64_t* addresses = addresses_in.data();
  AddressMap<int64_t> seen;
  std::vector<int64_t> first_address, first_row;
  for (size_t i = 0; i < n; ++i) {
    const int64_t act = actions[i];
    if (act != kAlloc && act != kFreeRequested && act != kFreeCompleted) continue;
    if (seen.find(addresses[i]) != nullptr) continue;
    seen.set(addresses[i], static_cast<int64_t>(i));
    first_address.push_back(addresses[i]);
    first_row.push_back(static_cast<int64_t>(i));
  }
  return nb::make_tuple(to_array(std::move(first_address)), to_array(std::move(first_row)));
}

}  // namespace
}  // namespace memlens

NB_MODULE(_native, m) {
  using namespace memlens;
  m.doc() = "memlens's native core: the caching-allocator model and the what-if replay loop (C++17).";
  // The memlens program leaves what is left at its exit to the OS, uncollected (gc.freeze in
  // memlens.cli.launch): nanobind would call those objects leaks.
  nb::set_leak_warnings(false);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const UsageError& e) {
      nb::object error = nb::module_::import_("memlens.errors").attr("MemlensUsageError");
      PyErr_SetString(error.ptr(), e.what());
    } catch (const OutOfMemory& e) {
      nb::object oom_type = nb::module_::import_("memlens.allocator.simulator").attr("SimulatedOOM");
      nb::object oom = oom_type(e.requested, e.rounded, e.device_free, e.allocated, e.reserved);
      PyErr_SetObject(oom_type.ptr(), oom.ptr());
    }
  });

  nb::class_<Simulator>(m, "Simulator")
      .def(nb::init<std::optional<int64_t>, std::vector<int64_t>, bool, std::optional<int64_t>, std::optional<int64_t>,
                    int64_t, bool, bool, nb::object, nb::object, nb::list, int64_t>(),
           "max_split_size"_a.none(), "divisions"_a, "expandable_segments"_a, "capacity"_a.none(), "allowed"_a.none(),
           "gc_threshold_bytes"_a, "gc_enabled"_a, "record_history"_a, "clock"_a.none(), "segment_addresses"_a.none(),
           "trace"_a, "device"_a)
      .def("round_size", [](Simulator& s, int64_t size) { return s.core().round_size(size); }, "size"_a)
      .def("malloc",
           [](Simulator& s, int64_t size, int64_t stream, nb::handle frames) {
             return s.core().malloc(size, stream, s.frames_of(frames));
           },
           "size"_a, "stream"_a = 0, "frames"_a.none() = nb::none())
      .def("free", [](Simulator& s, int64_t address, nb::handle frames) { s.core().free(address, s.frames_of(frames)); },
           "address"_a, "frames"_a.none() = nb::none())
      .def("request_free",
           [](Simulator& s, int64_t address, nb::handle frames) { s.core().request_free(address, s.frames_of(frames)); },
           "address"_a, "frames"_a.none() = nb::none())
      .def("complete_free",
           [](Simulator& s, int64_t address, nb::handle frames) { s.core().complete_free(address, s.frames_of(frames)); },
           "address"_a, "frames"_a.none() = nb::none())
      .def("empty_cache", [](Simulator& s, nb::handle frames) { s.core().empty_cache(s.frames_of(frames)); },
           "frames"_a.none() = nb::none())
      .def("is_allocated", [](Simulator& s, int64_t address) { return s.core().is_allocated(address); }, "address"_a)
      .def("cached_blocks", [](Simulator& s, bool small, int64_t stream) { return s.core().cached_blocks(small, stream); },
           "small"_a, "stream"_a)
      .def("cached_summary",
           [](Simulator& s, bool small, int64_t stream, bool pieces_only) {
             return s.core().cached_summary(small, stream, pieces_only);
           },
           "small"_a, "stream"_a, "pieces_only"_a = false)
      .def("segment_base", [](Simulator& s, int64_t address) { return s.core().segment_base(address); }, "address"_a)
      .def("_restore_segment",
           [](Simulator& s, int64_t address, int64_t total_size, int64_t stream, std::optional<bool> is_small,
              std::vector<std::tuple<int64_t, int64_t, int64_t>> live) {
             s.core().restore_segment(address, total_size, stream, is_small, std::move(live));
           })
      .def("_segments", &Simulator::segments)
      .def("_blocks", &Simulator::blocks)
      .def("_check_invariants", [](Simulator& s) { return s.core().check_invariants(); })
      .def_prop_ro("device_free_bytes", [](Simulator& s) { return s.core().device_free(); })
      .def_prop_rw("record_history", [](Simulator& s) { return s.core().record_history; },
                   [](Simulator& s, bool value) { s.core().record_history = value; })
#define MEMLENS_COUNTER(name)                                                                      \
  .def_prop_rw(#name, [](Simulator& s) { return s.core().name; }, [](Simulator& s, int64_t value) { \
    s.core().name = value;                                                                         \
  })
      MEMLENS_COUNTER(reserved_bytes) MEMLENS_COUNTER(allocated_bytes) MEMLENS_COUNTER(requested_bytes)
      MEMLENS_COUNTER(peak_reserved_bytes) MEMLENS_COUNTER(peak_allocated_bytes) MEMLENS_COUNTER(segment_alloc_count)
      MEMLENS_COUNTER(segment_free_count) MEMLENS_COUNTER(segment_map_count) MEMLENS_COUNTER(segment_unmap_count)
      MEMLENS_COUNTER(alloc_retries) MEMLENS_COUNTER(oom_count);
#undef MEMLENS_COUNTER

  m.def("replay", &replay, "simulator"_a, "actions"_a, "addresses"_a, "sizes"_a, "streams"_a, "completes"_a,
        "empty_cache_at"_a, "hint_addresses"_a, "hint_sizes"_a, "use_recorded_addresses"_a, "seeded_live"_a,
        "recorded_initial"_a, "over_capacity"_a, "observer"_a.none(), "watch"_a.none() = nb::none());
  m.def("completed_requests", &completed_requests, "actions"_a, "addresses"_a);
  m.def("first_block_events", &first_block_events, "actions"_a, "addresses"_a);
  m.def("get_allocation_size", &get_allocation_size, "size"_a);

  nb::dict declared;
  add_declared(declared, kBlockRules);
  add_declared(declared, kAllocatorConstants);
  add_declared(declared, kActionCodes);
  m.attr("DECLARED") = declared;
}
