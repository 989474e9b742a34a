// memlens.snapshot._kernels: the snapshot's passes over a trace's columns, each a copy of a Python
// function that stays its reference (memlens.snapshot.engine.native_kernels is their door; docs/native.md):
// the block sizes (memlens.snapshot.blocks: group_memory_rows, sweep_large_blocks), the lifetimes'
// pairing (memlens.analysis.lifetimes: pair_lifetime_rows), window completeness and the memory
// curves (memlens.snapshot.curves: history_allocates_first, curve_changes), and the timeline's envelope
// of a curve (memlens.snapshot.envelope: column_envelope). A module of its own,
// apart from the allocator model (memlens._native), so that the snapshot owns its native door.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "actions.hpp"
#include "address_map.hpp"
#include "block_rules.hpp"
#include "columns.hpp"
#include "usage_error.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace memlens {
namespace {

// ------------------------------------------------------------------ block sizes
// memlens.snapshot.blocks._sweep_large_blocks, step for step: give every large-pool alloc (and
// block freed before its alloc was seen) the tail ``should_split`` left on it, in place in ``out``.
// Returns false, changing nothing, where an address or size lies outside the range whose sums
// int64 holds (the Python pass, on unbounded integers, measures those).

bool sweep_large_blocks(Sizes out_in, Codes action_in, Column address_in, Mask large_in, int64_t release,
                        Column segment_addresses, Column segment_sizes, int64_t max_split, Column ghost_rows_in,
                        Column untouched_in) {
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
    return 0 <= addr && addr <= kMaxModelledAddress && 0 <= size && size <= kMaxModelledRequest;
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

// ------------------------------------------------------------------ the timeline's envelope
// memlens.snapshot.envelope.column_envelope_reference, step for step: rows [start, end) of ``values``
// cut into columns of ``width`` rows (the last one shorter), and of each column the row of its least
// and the row of its greatest value (the first such row, as numpy's argmin and argmax give). What the
// timeline draws of a curve of millions of rows: a few thousand rows whose every column keeps its
// true minimum and maximum.
nb::tuple column_envelope(Column values_in, int64_t start, int64_t end, int64_t width) {
  const int64_t rows = static_cast<int64_t>(values_in.shape(0));
  if (start < 0 || end > rows || start > end) throw UsageError("envelope rows out of range");
  if (width < 1) throw UsageError("an envelope's columns need at least one row each");
  const int64_t count = end - start;
  const int64_t columns = count / width + (count % width != 0 ? 1 : 0);
  std::vector<int64_t> lows(static_cast<size_t>(columns)), highs(static_cast<size_t>(columns));
  const int64_t* values = values_in.data();
  {
    nb::gil_scoped_release released;  // the column needs no Python
    for (int64_t column = 0; column < columns; ++column) {
      const int64_t first = start + column * width;
      const int64_t last = std::min(first + width, end);
      // The extremes' values first (a loop without a carried row index, which the compiler
      // unrolls and vectorizes), then the first row holding each (a short scan that stops there).
      int64_t low_value = values[first], high_value = values[first];
      for (int64_t row = first + 1; row < last; ++row) {
        low_value = std::min(low_value, values[row]);
        high_value = std::max(high_value, values[row]);
      }
      int64_t low = first, high = first;
      while (values[low] != low_value) ++low;
      while (values[high] != high_value) ++high;
      lows[static_cast<size_t>(column)] = low;
      highs[static_cast<size_t>(column)] = high;
    }
  }
  return nb::make_tuple(to_array(std::move(lows)), to_array(std::move(highs)));
}

}  // namespace
}  // namespace memlens

NB_MODULE(_kernels, m) {
  using namespace memlens;
  m.doc() = "memlens's snapshot kernels: block sizes, lifetime pairing and memory curves (C++17).";
  nb::set_leak_warnings(false);  // as memlens._native: the program leaves its exit's objects to the OS

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const UsageError& e) {
      nb::object error = nb::module_::import_("memlens.errors").attr("MemlensUsageError");
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  nb::dict declared;
  add_declared(declared, kBlockRules);
  add_declared(declared, kActionCodes);
  m.attr("DECLARED") = declared;

  m.def("group_memory_rows", &group_memory_rows, "action"_a, "address"_a, "release"_a);
  m.def("pair_lifetime_rows", &pair_lifetime_rows, "action"_a, "address"_a, "free_action"_a);
  m.def("history_allocates_first", &history_allocates_first, "action"_a, "address"_a, "free_action"_a, "live"_a);
  m.def("curve_changes", &curve_changes, "action"_a, "block_size"_a, "size"_a, "allocated"_a, "reserved"_a,
        "frees_at_request"_a, "track_pending"_a);
  m.def("column_envelope", &column_envelope, "values"_a, "start"_a, "end"_a, "width"_a);
  m.def("sweep_large_blocks", &sweep_large_blocks, "out"_a, "action"_a, "address"_a, "large"_a, "release"_a,
        "segment_addresses"_a, "segment_sizes"_a, "max_split"_a, "ghost_rows"_a, "untouched"_a);
}
