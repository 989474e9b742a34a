// memlens._native: the caching-allocator model (caching_allocator.hpp) for Python, and the what-if
// replay loop over a trace's columns (memlens.allocator.replay._Replay.run, event for event).
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
#include <limits>
#include <map>
#include <set>

#include "caching_allocator.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace memlens {
namespace {

using Column = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Mask = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Codes = nb::ndarray<const int8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;  // action codes
// A column of any stride: a stream column that holds one value throughout is one element with a
// zero stride (memlens.snapshot.model.constant_column), read in place rather than written out.
using StridedColumn = nb::ndarray<const int64_t, nb::ndim<1>, nb::device::cpu>;


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
constexpr int kAlloc = 0, kFreeRequested = 1, kFreeCompleted = 2, kSegmentAlloc = 3, kSegmentFree = 4,
              kSegmentMap = 5, kSegmentUnmap = 6, kOom = 7;
// How far ahead in the recorded segment_alloc list a simulated cudaMalloc may look (_ADDRESS_HINT_LOOKAHEAD).
constexpr int kAddressHintLookahead = 8;

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

// A vector handed to numpy without a copy: the array owns it from now on.
template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_array(std::vector<T>&& values) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(owned->data(), {owned->size()}, owner);
}

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

// ------------------------------------------------------------------ block sizes
// memlens.snapshot.blocks._sweep_large_blocks, step for step: give every large-pool alloc (and
// block freed before its alloc was seen) the tail ``should_split`` left on it, in place in ``out``.
// Returns false, changing nothing, where an address or size lies outside the range whose sums
// int64 holds (the Python pass, on unbounded integers, measures those).
using Sizes = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

bool sweep_large_blocks(Sizes out_in, Codes action_in, Column address_in, Mask large_in, int64_t release,
                        Column segment_addresses, Column segment_sizes, int64_t max_split, Column ghost_rows_in,
                        Column untouched_in) {
  constexpr int64_t kAddressLimit = int64_t(1) << 62, kSizeLimit = int64_t(1) << 60;
  const size_t n = action_in.shape(0);
  if (out_in.shape(0) != n || address_in.shape(0) != n || large_in.shape(0) != n ||
      segment_addresses.shape(0) != segment_sizes.shape(0)) {
    throw UsageError("block size columns differ in length");
  }
  int64_t* out = out_in.data();
  const int8_t* action = action_in.data();
  const int64_t* address = address_in.data();
  const uint8_t* large = large_in.data();
  const int64_t* ghost_rows = ghost_rows_in.data();
  const size_t ghosts = ghost_rows_in.shape(0);
  auto in_range = [&](int64_t addr, int64_t size) {
    return 0 <= addr && addr <= kAddressLimit && 0 <= size && size <= kSizeLimit;
  };
  // The rows the pass reads, in order; the sizes as they were before it changed any.
  std::vector<size_t> relevant;
  bool any_large_alloc = false;
  for (size_t i = 0; i < n; ++i) {
    const int64_t act = action[i];
    const bool large_alloc = large[i] && act == kAlloc;
    if (large_alloc || (large[i] && act == release) || act == kSegmentAlloc || act == kSegmentFree) {
      if (!in_range(address[i], out[i])) return false;
      relevant.push_back(i);
      any_large_alloc |= large_alloc;
    }
  }
  for (size_t k = 0; k < ghosts; ++k) {
    if (ghost_rows[k] < 0 || static_cast<size_t>(ghost_rows[k]) >= n) throw UsageError("ghost row out of range");
    if (!in_range(address[ghost_rows[k]], out[ghost_rows[k]])) return false;
  }
  for (size_t k = 0; k < segment_addresses.shape(0); ++k) {
    if (!in_range(segment_addresses.data()[k], segment_sizes.data()[k])) return false;
  }
  for (size_t k = 0; k < untouched_in.shape(0); ++k) {
    if (!in_range(untouched_in.data()[k], 0)) return false;
  }
  if (!any_large_alloc && ghosts == 0) return true;
  std::vector<int64_t> sizes(relevant.size());
  for (size_t k = 0; k < relevant.size(); ++k) sizes[k] = out[relevant[k]];

  // The segments when the window opened: those it closed without opening them first, and
  // those still there at the end that it did not open.
  AddressMap<int64_t> opened;
  std::map<int64_t, int64_t> segments;  // start -> size: seg_starts and seg_size
  for (size_t k = 0; k < relevant.size(); ++k) {
    const int64_t act = action[relevant[k]], addr = address[relevant[k]];
    if (act == kSegmentAlloc) {
      opened.set(addr, sizes[k]);
    } else if (act == kSegmentFree && !opened.erase(addr)) {
      segments.try_emplace(addr, sizes[k]);
    }
  }
  for (size_t k = 0; k < segment_addresses.shape(0); ++k) {
    if (!opened.contains(segment_addresses.data()[k])) segments.try_emplace(segment_addresses.data()[k], segment_sizes.data()[k]);
  }

  std::set<int64_t> occupied(untouched_in.data(), untouched_in.data() + untouched_in.shape(0));
  for (size_t k = 0; k < ghosts; ++k) occupied.insert(address[ghost_rows[k]]);
  struct Held {
    int64_t row = -1, rounded = 0;
  };
  AddressMap<Held> block_at;  // occupied start -> the row whose block starts there, its rounded size

  // Where the free block starting at ``addr`` ends: the next occupied start or the segment's
  // end; none when no known large-pool segment holds ``addr``.
  auto boundary = [&](int64_t addr) -> std::optional<int64_t> {
    auto segment = segments.upper_bound(addr);
    if (segment == segments.begin()) return std::nullopt;
    --segment;
    const int64_t end = segment->first + segment->second;
    if (addr >= end || segment->second <= kSmallBuffer) return std::nullopt;
    auto after = occupied.upper_bound(addr);
    return after != occupied.end() ? std::min(end, *after) : end;
  };

  // Blocks allocated before the window: a gap of 1 MiB or less after one is its kept tail.
  for (size_t k = 0; k < ghosts; ++k) {
    const int64_t row = ghost_rows[k], addr = address[row], rounded = out[row];
    block_at.set(addr, Held{row, rounded});
    std::optional<int64_t> end = boundary(addr);
    if (end) {
      const int64_t gap = *end - (addr + rounded);
      if (0 < gap && gap <= kSmallSize) out[row] += gap;
    }
  }

  for (size_t k = 0; k < relevant.size(); ++k) {
    const int64_t row = static_cast<int64_t>(relevant[k]), act = action[row], addr = address[row];
    const int64_t row_size = sizes[k];
    if (act == kAlloc) {
      std::optional<int64_t> end = boundary(addr);
      if (end && *end - addr >= row_size) {
        const int64_t remaining = *end - addr - row_size;
        if (!(row_size < max_split && remaining > kSmallSize)) out[row] = *end - addr;  // should_split said no
      }
      auto at = occupied.lower_bound(addr);
      if (at != occupied.begin()) {
        const int64_t before = *std::prev(at);
        if (const Held* earlier = block_at.find(before)) {
          // A block inside another's tail: the earlier block ends where this one starts.
          out[earlier->row] = std::min(out[earlier->row], std::max(addr - before, earlier->rounded));
        }
      }
      occupied.insert(addr);
      block_at.set(addr, Held{row, row_size});
    } else if (act == release) {
      if (occupied.erase(addr)) block_at.erase(addr);
    } else if (act == kSegmentAlloc) {
      segments[addr] = row_size;
    } else if (act == kSegmentFree) {
      segments.erase(addr);
    }
  }
  return true;
}

// memlens.snapshot.blocks._group_rows in one pass in row order (the Python one sorts the rows by
// address): each alloc/free row's place in its address's history. Returns
// (carry_rows, carry_from, ghost_heads, touched, standing):
// * each free row that belongs to an alloc, with that alloc's row; each later free row of a block
//   whose alloc the window lacks, with the first of them (its block is measured there);
// * ghost_heads: the first rows of the addresses whose first row is a free (by row);
// * touched: every address a row touches, ascending;
// * standing: the last alloc at each address when no release follows it (by row).
nb::tuple group_memory_rows(Codes action_in, Column address_in, int64_t release) {
  const size_t n = action_in.shape(0);
  if (address_in.shape(0) != n) throw UsageError("history columns differ in length");
  const int8_t* action = action_in.data();
  const int64_t* address = address_in.data();
  struct History {
    int64_t last_alloc = -1, last_release = -1, head = -1;
    bool after_release = false;  // the previous row at the address released its block
  };
  AddressMap<History> histories;
  std::vector<int64_t> carry_rows, carry_from, ghost_heads, touched;
  for (size_t i = 0; i < n; ++i) {
    const int64_t act = action[i];
    if (act != kAlloc && act != kFreeRequested && act != kFreeCompleted) continue;
    const int64_t row = static_cast<int64_t>(i), addr = address[i];
    History* history = histories.find(addr);
    const bool first = history == nullptr;
    if (first) {
      histories.set(addr, History{});
      history = histories.find(addr);
      touched.push_back(addr);
    }
    if (act == kAlloc) {
      history->last_alloc = row;
      history->after_release = false;
      continue;
    }
    // Owned: the last alloc here came after the last release here (a ring buffer or a writer
    // may have lost the alloc of the block this row frees).
    if (history->last_alloc > history->last_release) {
      carry_rows.push_back(row);
      carry_from.push_back(history->last_alloc);
    } else if (first || history->after_release) {
      history->head = row;
      if (first) ghost_heads.push_back(row);
    } else {
      // The row before this one here is a free without its alloc too, so a head precedes it.
      if (history->head < 0) throw std::logic_error("block sizes: a free row without its block's first row");
      carry_rows.push_back(row);
      carry_from.push_back(history->head);
    }
    if (act == release) history->last_release = row;
    history->after_release = act == release;
  }
  std::vector<int64_t> standing;
  histories.for_each([&standing](int64_t, const History& history) {
    if (history.last_alloc >= 0 && history.last_alloc > history.last_release) standing.push_back(history.last_alloc);
  });
  std::sort(standing.begin(), standing.end());
  std::sort(touched.begin(), touched.end());
  return nb::make_tuple(to_array(std::move(carry_rows)), to_array(std::move(carry_from)),
                        to_array(std::move(ghost_heads)), to_array(std::move(touched)), to_array(std::move(standing)));
}

// memlens.analysis.lifetimes._pair_rows: the alloc and free rows ordered by (address, row), as
// numpy's lexsort orders them, and each alloc's end: the next row at its address (n where none
// follows). Returns (alloc_event, free_event, ghost_free_rows), in that order: the frees with no
// alloc just before them at their address are the ghost rows (their blocks predate the window).
// A counting sort by address: the distinct addresses are sorted, the rows of each keep row order.
// The rows of pair_lifetime_rows grouped by address, then row: a counting sort in two passes over
// the action column (one to count each address's rows, one to place them), with row indices of
// `Index` (32 bits where the trace allows): a few bytes per row, never a copy of a whole column.
template <typename Index>
void pair_rows(const int8_t* action, const int64_t* address, size_t n, int64_t free_action,
               std::vector<int64_t>& alloc_event, std::vector<int64_t>& free_event,
               std::vector<int64_t>& ghost_free_rows) {
  auto relevant = [&](size_t i) { return action[i] == kAlloc || action[i] == free_action; };
  AddressMap<int64_t> group_of;  // address -> its group
  std::vector<int64_t> group_address, group_start;  // group_start: its rows' count, then their offset
  std::vector<Index> row_group;  // per relevant row, in row order
  size_t m = 0, allocs = 0;
  for (size_t i = 0; i < n; ++i) m += relevant(i), allocs += action[i] == kAlloc;
  row_group.reserve(m);
  for (size_t i = 0; i < n; ++i) {
    if (!relevant(i)) continue;
    const int64_t* found = group_of.find(address[i]);
    int64_t group;
    if (found == nullptr) {
      group = static_cast<int64_t>(group_address.size());
      group_of.set(address[i], group);
      group_address.push_back(address[i]);
      group_start.push_back(0);
    } else {
      group = *found;
    }
    group_start[group] += 1;
    row_group.push_back(static_cast<Index>(group));
  }
  const size_t groups = group_address.size();
  std::vector<Index> by_address(groups);  // the groups in address order
  for (size_t g = 0; g < groups; ++g) by_address[g] = static_cast<Index>(g);
  std::sort(by_address.begin(), by_address.end(),
            [&group_address](Index a, Index b) { return group_address[a] < group_address[b]; });
  std::vector<int64_t>().swap(group_address);
  int64_t offset = 0;
  for (Index g : by_address) {
    const int64_t count = group_start[g];
    group_start[g] = offset;
    offset += count;
  }
  std::vector<Index> sorted(m);  // the relevant rows by (address, row)
  {
    std::vector<int64_t> cursor(group_start);
    size_t k = 0;
    for (size_t i = 0; i < n; ++i) {
      if (relevant(i)) sorted[static_cast<size_t>(cursor[row_group[k++]]++)] = static_cast<Index>(i);
    }
  }
  std::vector<Index>().swap(row_group);
  alloc_event.reserve(allocs);
  free_event.reserve(allocs);
  // The groups in address order, each one's rows in row order; a group's rows end where the
  // next group's start.
  size_t k = 0;
  for (size_t position = 0; position < groups; ++position) {
    const size_t group_end = position + 1 < groups ? static_cast<size_t>(group_start[by_address[position + 1]]) : m;
    for (; k < group_end; ++k) {
      const auto row = static_cast<int64_t>(sorted[k]);
      const bool same_as_next = k + 1 < group_end;
      if (action[row] == kAlloc) {
        alloc_event.push_back(row);
        // The next row at the same address ends the lifetime; when it is another alloc (the
        // ring buffer lost the free) the lifetime ends there, the best bound the trace gives.
        free_event.push_back(same_as_next ? static_cast<int64_t>(sorted[k + 1]) : static_cast<int64_t>(n));
      } else {
        const bool first_of_group = k == static_cast<size_t>(group_start[by_address[position]]);
        const bool preceded = !first_of_group && action[sorted[k - 1]] == kAlloc;
        if (!preceded) ghost_free_rows.push_back(row);
      }
    }
  }
}

nb::tuple pair_lifetime_rows(Codes action_in, Column address_in, int64_t free_action) {
  const size_t n = action_in.shape(0);
  if (address_in.shape(0) != n) throw UsageError("history columns differ in length");
  std::vector<int64_t> alloc_event, free_event, ghost_free_rows;
  if (n < (size_t(1) << 31)) {
    pair_rows<uint32_t>(action_in.data(), address_in.data(), n, free_action, alloc_event, free_event, ghost_free_rows);
  } else {
    pair_rows<uint64_t>(action_in.data(), address_in.data(), n, free_action, alloc_event, free_event, ghost_free_rows);
  }
  return nb::make_tuple(to_array(std::move(alloc_event)), to_array(std::move(free_event)),
                        to_array(std::move(ghost_free_rows)));
}

// memlens.snapshot.curves._window_complete's test of the rows, in one pass: every address's first
// alloc-or-free row is an alloc, and every block live at the dump was allocated in the window.
// (The Python reference sorts every address to find each one's first row.)
bool history_allocates_first(Codes action_in, Column address_in, int64_t free_action, Column live_in) {
  const size_t n = action_in.shape(0);
  if (address_in.shape(0) != n) throw UsageError("history columns differ in length");
  const int8_t* action = action_in.data();
  const int64_t* address = address_in.data();
  AddressMap<bool> seen;  // addresses whose first row was an alloc
  for (size_t i = 0; i < n; ++i) {
    const int64_t act = action[i];
    if (act != kAlloc && act != free_action) continue;
    if (seen.contains(address[i])) continue;
    if (act != kAlloc) return false;  // freed before any alloc there: allocated before the window
    seen.set(address[i], true);
  }
  for (size_t k = 0; k < live_in.shape(0); ++k) {
    if (!seen.contains(live_in.data()[k])) return false;
  }
  return true;
}

// ------------------------------------------------------------------ memory curves
// memlens.snapshot.curves._curve_changes in one pass over the rows, without its full-size
// temporaries (a sign column, its products, np.abs of each sum, the pending-free sum). Fills
// ``allocated`` and ``reserved`` with the running allocated and reserved change after each row,
// exactly numpy's int64 cumsums, wrapping as they wrap (modulo 2**64), so that the caller's
// overflow test reads the very sums the reference gives. Returns (the last allocated change, the
// largest |allocated change|, the last reserved change, the largest |reserved change|, the last
// pending-free change, the largest pending-free change), each as numpy gives it (np.abs wraps
// too: |INT64_MIN| is INT64_MIN); the pending figures are 0 unless ``track_pending``. A block
// leaves the allocated curve at its free_requested row when ``frees_at_request``, else at its
// free_completed row. Returns None for an action code that is not an Action: the reference
// indexes its tables with the codes, so it alone says what such a column gives.
nb::object curve_changes(Codes action_in, Column block_size_in, Column size_in, Sizes allocated_in,
                         Sizes reserved_in, bool frees_at_request, bool track_pending) {
  constexpr int kActionCount = 10;  // memlens.snapshot.model.Action
  const size_t n = action_in.shape(0);
  if (block_size_in.shape(0) != n || size_in.shape(0) != n || allocated_in.shape(0) != n ||
      reserved_in.shape(0) != n) {
    throw UsageError("curve columns differ in length");
  }
  const int8_t* action = action_in.data();
  const int64_t* block_size = block_size_in.data();
  const int64_t* size = size_in.data();
  int64_t* allocated = allocated_in.data();
  int64_t* reserved = reserved_in.data();
  const int release = frees_at_request ? kFreeRequested : kFreeCompleted;
  // The sums in uint64_t: its arithmetic wraps as numpy's int64 does, where int64_t's overflow is
  // undefined. Back to int64_t modulo 2**64: implementation-defined before C++20, and so on every
  // compiler memlens builds with (GCC, Clang, MSVC).
  auto as_signed = [](uint64_t value) { return static_cast<int64_t>(value); };
  auto magnitude = [&](uint64_t value) { return as_signed(as_signed(value) < 0 ? 0 - value : value); };
  uint64_t allocated_sum = 0, reserved_sum = 0, pending_sum = 0;
  int64_t allocated_largest = std::numeric_limits<int64_t>::min(), reserved_largest = allocated_largest,
          pending_largest = allocated_largest;
  bool foreign_code = false;
  {
    nb::gil_scoped_release released;  // the columns need no Python
    for (size_t i = 0; i < n; ++i) {
      const int act = action[i];
      if (act < 0 || act >= kActionCount) {
        foreign_code = true;
        break;
      }
      const uint64_t block = static_cast<uint64_t>(block_size[i]);
      if (act == kAlloc) {
        allocated_sum += block;
      } else if (act == release) {
        allocated_sum -= block;
      }
      if (act == kSegmentAlloc || act == kSegmentMap) {
        reserved_sum += static_cast<uint64_t>(size[i]);
      } else if (act == kSegmentFree || act == kSegmentUnmap) {
        reserved_sum -= static_cast<uint64_t>(size[i]);
      }
      allocated[i] = as_signed(allocated_sum);
      reserved[i] = as_signed(reserved_sum);
      allocated_largest = std::max(allocated_largest, magnitude(allocated_sum));
      reserved_largest = std::max(reserved_largest, magnitude(reserved_sum));
      if (track_pending) {
        if (act == kFreeRequested) {
          pending_sum += block;
        } else if (act == kFreeCompleted) {
          pending_sum -= block;
        }
        pending_largest = std::max(pending_largest, as_signed(pending_sum));
      }
    }
  }
  if (foreign_code) return nb::none();
  if (n == 0) allocated_largest = reserved_largest = pending_largest = 0;  // numpy has no max of nothing
  if (!track_pending) pending_largest = 0;
  return nb::make_tuple(as_signed(allocated_sum), allocated_largest, as_signed(reserved_sum), reserved_largest,
                        as_signed(pending_sum), pending_largest);
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
  m.def("get_allocation_size", &get_allocation_size, "size"_a);
  m.def("group_memory_rows", &group_memory_rows, "action"_a, "address"_a, "release"_a);
  m.def("pair_lifetime_rows", &pair_lifetime_rows, "action"_a, "address"_a, "free_action"_a);
  m.def("history_allocates_first", &history_allocates_first, "action"_a, "address"_a, "free_action"_a, "live"_a);
  m.def("curve_changes", &curve_changes, "action"_a, "block_size"_a, "size"_a, "allocated"_a, "reserved"_a,
        "frees_at_request"_a, "track_pending"_a);
  m.def("sweep_large_blocks", &sweep_large_blocks, "out"_a, "action"_a, "address"_a, "large"_a, "release"_a,
        "segment_addresses"_a, "segment_sizes"_a, "max_split"_a, "ghost_rows"_a, "untouched"_a);
}
