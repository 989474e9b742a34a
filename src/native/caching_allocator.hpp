// A C++17 model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), the
// native engine of memlens.allocator.
//
// The Python class memlens.allocator.simulator.CachingAllocatorSimulator is the reference model;
// this file follows it (and through it DeviceCachingAllocator) function by function, under the
// upstream names: round_size, get_allocation_size, get_free_block, should_split,
// alloc_found_block, free_block, try_merge_blocks, alloc_block, release_block,
// release_available_cached_blocks, release_cached_blocks, garbage_collect_cached_blocks and the
// expandable-segment map/unmap. The differential tests (tests/unit/test_native_*.py) replay the
// same traces through both and compare every block.
//
// Frames (the Python stack records a block carries) are held as Python objects: the simulator
// never looks inside them, it only keeps them with the blocks and hands them to the recorder.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory_resource>
#include <new>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <nanobind/nanobind.h>

#include "address_map.hpp"
#include "allocator_constants.hpp"
#include "block_rules.hpp"
#include "usage_error.hpp"

namespace memlens {

using Frames = nanobind::object;  // a Python list of frame dicts, None, or unset

// CUDACachingAllocator.cpp's constants (kMinBlockSize, kSmallSize, kSmallBuffer, kLargeBuffer,
// kMinLargeAlloc, kRoundLarge, kRoundupIntervals, kRoundupIntervalStartLog2) and what the model
// covers (kMaxModelledRequest: the largest request, far above any device and small enough that
// every rounding and address sum below stays inside int64; kMaxModelledAddress) are declared once
// in memlens/snapshot/block_rules.py, the model's defaults (kDefaultBaseAddress,
// kSegmentAlignment, kDefaultDeviceMemory, kDefaultStartTimeUs) in memlens/allocator/constants.py:
// CMake writes these two headers from them (src/native/generate_constants.py).


// malloc could not be satisfied within the capacity after freeing cached blocks (SimulatedOOM).
struct OutOfMemory : std::exception {
  int64_t requested, rounded, device_free, allocated, reserved;
  OutOfMemory(int64_t requested_, int64_t rounded_, int64_t device_free_, int64_t allocated_, int64_t reserved_)
      : requested(requested_), rounded(rounded_), device_free(device_free_), allocated(allocated_), reserved(reserved_) {}
  const char* what() const noexcept override { return "simulated CUDA out of memory"; }
};

std::string hex(int64_t value);  // Python's f"{value:#x}"

// Disjoint address ranges (start -> size), and the one that holds an address. What ``start_of``
// found is remembered per 2 MiB stretch of address in a small direct-mapped table, forgotten
// whenever a range is added or removed: the replay asks at every allocation and the ranges (live
// segments) change only at segment rows, and the tree walk, a cache miss per level over thousands
// of segments, was a quarter of the replay loop.
class RangeMap {
 public:
  void set(int64_t start, int64_t size) {
    sizes_[start] = size;
    generation_ += 1;
  }
  void erase(int64_t start) {
    sizes_.erase(start);
    generation_ += 1;
  }
  // Whether [start, start + size) meets a range: of those starting before its end, the last one
  // ends last (they never overlap each other).
  bool overlaps(int64_t start, int64_t size) const {
    auto before_end = sizes_.lower_bound(start + size);
    if (before_end == sizes_.begin()) return false;
    --before_end;
    return start < before_end->first + before_end->second;
  }

  std::optional<int64_t> start_of(int64_t address) const {
    Found& found = found_[(static_cast<uint64_t>(address) >> 21) % found_.size()];
    if (found.generation == generation_ && found.start <= address && address < found.end) return found.start;
    auto after = sizes_.upper_bound(address);
    if (after == sizes_.begin()) return std::nullopt;
    --after;
    if (address < after->first + after->second) {
      // Remembered up to the next range's start too: where ranges overlap (a hostile file's
      // segments), an address past it belongs to that one, as the uncached walk finds.
      const auto next = std::next(after);
      const int64_t end = after->first + after->second;
      found = {generation_, after->first, next != sizes_.end() ? std::min(end, next->first) : end};
      return after->first;
    }
    return std::nullopt;
  }

 private:
  struct Found {
    uint64_t generation = 0;  // valid while it equals generation_ (which starts at 1)
    int64_t start = 0, end = 0;
  };
  std::map<int64_t, int64_t> sizes_;
  uint64_t generation_ = 1;
  mutable std::array<Found, 256> found_{};  // a cache of lookups: no change to what the map holds
};

struct ExpandableSegment {  // a reserved virtual address range whose pages are mapped on demand
  int64_t base, page_size, size, stream;
};

struct Block {  // one Block: allocated, pending free, cached, or (expandable) unmapped
  int64_t address, size, stream;
  bool is_small;
  int64_t requested_size = 0;
  bool allocated = false;
  bool pending = false;  // freed by the caller, not yet reusable (free_requested only)
  bool mapped = true;
  ExpandableSegment* expandable = nullptr;
  Block* prev = nullptr;
  Block* next = nullptr;
  Frames frames;
  Frames segment_frames;
  int64_t gc_base = 0;

  Block(int64_t address_, int64_t size_, int64_t stream_, bool is_small_)
      : address(address_), size(size_), stream(stream_), is_small(is_small_) {}
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

// The memory of the Blocks and the sets' nodes: a free list per size class (16-byte steps), fed
// from 64 KiB chunks and returned only when the allocator goes. The replay makes and drops a
// Block and a set node or two per event; this takes and gives back each in a few instructions
// (std::pmr::unsynchronized_pool_resource searched its pools on every call).
class NodeMemory : public std::pmr::memory_resource {
 public:
  NodeMemory() = default;
  NodeMemory(const NodeMemory&) = delete;
  NodeMemory& operator=(const NodeMemory&) = delete;
  ~NodeMemory() override {
    for (void* chunk : chunks_) ::operator delete(chunk);
  }

 private:
  static constexpr size_t kStep = 16, kClasses = 16, kChunkBytes = 64 << 10;
  struct FreeNode {
    FreeNode* next;
  };

  void* do_allocate(size_t bytes, size_t alignment) override {
    const size_t index = (bytes + kStep - 1) / kStep;
    if (index == 0 || index >= kClasses || alignment > kStep) return ::operator new(bytes, std::align_val_t(alignment));
    if (FreeNode* node = free_[index]) {
      free_[index] = node->next;
      return node;
    }
    const size_t size = index * kStep;
    if (left_ < size) {
      chunks_.push_back(::operator new(kChunkBytes));  // aligned for any fundamental type, so for kStep
      cursor_ = static_cast<char*>(chunks_.back());
      left_ = kChunkBytes;
    }
    void* memory = cursor_;
    cursor_ += size;
    left_ -= size;
    return memory;
  }

  void do_deallocate(void* memory, size_t bytes, size_t alignment) override {
    const size_t index = (bytes + kStep - 1) / kStep;
    if (index == 0 || index >= kClasses || alignment > kStep) {
      ::operator delete(memory, std::align_val_t(alignment));
      return;
    }
    auto* node = static_cast<FreeNode*>(memory);
    node->next = free_[index];
    free_[index] = node;
  }

  bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override { return this == &other; }

  FreeNode* free_[kClasses] = {};
  std::vector<void*> chunks_;
  char* cursor_ = nullptr;
  size_t left_ = 0;
};

// A cached block in its pool's set, its key held in the node: best fit compares sizes without
// reading the Block (a cache miss per tree level otherwise). A block's size and address never
// change while it is in the set (every change is made to a block taken out of it first).
struct FreeEntry {
  int64_t size, address;
  Block* block;
  // A whole cached segment (unsplit, not expandable) when it went in: what FreeTotals counted it as.
  bool whole = false;
  FreeEntry(Block* block_)  // NOLINT: implicit
      : size(block_->size), address(block_->address), block(block_),
        whole(!block_->is_split() && block_->expandable == nullptr) {}
  FreeEntry(int64_t size_, int64_t address_) : size(size_), address(address_), block(nullptr) {}
  operator Block*() const { return block; }  // NOLINT: implicit, the set reads as a set of blocks
};
// BlockComparatorSize within one (pool, stream): by size, ties to the lower address.
struct BySizeThenAddress {
  bool operator()(const FreeEntry& a, const FreeEntry& b) const {
    return a.size != b.size ? a.size < b.size : a.address < b.address;
  }
};
struct ByAddress {
  bool operator()(const Block* a, const Block* b) const { return a->address < b->address; }
};
// The sets' nodes come from the allocator's own pool (no malloc per cached block).
// The sums over one (pool, stream)'s cached blocks that cached_summary reports, kept as blocks go
// in and out (bookkeeping of ours, no upstream rule): the fragmentation analysis asks at every
// cudaMalloc of a replay, and summing the blocks each time made a long replay quadratic.
struct FreeTotals {
  int64_t bytes = 0, whole_bytes = 0, whole_count = 0;
  void add(const FreeEntry& entry, int64_t sign) {
    bytes += sign * entry.size;
    if (entry.whole) {
      whole_bytes += sign * entry.size;
      whole_count += sign;
    }
  }
};

// One (pool, stream)'s cached blocks, best fit first, with their running totals beside them (one
// lookup finds both).
struct FreeBlocks : std::pmr::set<FreeEntry, BySizeThenAddress> {
  using std::pmr::set<FreeEntry, BySizeThenAddress>::set;
  FreeTotals totals;
};
using UnmappedBlocks = std::pmr::set<Block*, ByAddress>;

struct BlockPool {  // BlockPool: cached (free, mapped) blocks per stream; unmapped ranges per stream
  BlockPool(bool small, std::pmr::memory_resource* memory_) : is_small(small), memory(memory_) {}
  bool is_small;
  std::pmr::memory_resource* memory;
  std::map<int64_t, FreeBlocks> blocks;       // stream -> cached blocks, best fit first
  std::map<int64_t, UnmappedBlocks> unmapped;  // stream -> unmapped expandable blocks by address
  int64_t free_calls = 0;                     // get_free_blocks_call_count, the clock of garbage collection
  FreeBlocks& stream_blocks(int64_t stream) { return blocks.try_emplace(stream, memory).first->second; }
  UnmappedBlocks& stream_unmapped(int64_t stream) { return unmapped.try_emplace(stream, memory).first->second; }
};

enum class Action { alloc, free_requested, free_completed, segment_alloc, segment_free, segment_map, segment_unmap, oom };
const char* action_name(Action action);

struct Settings {
  std::optional<int64_t> max_split_size;  // unset = SIZE_MAX
  std::vector<int64_t> divisions;         // roundup_power2_divisions per interval
  bool expandable_segments = false;
  std::optional<int64_t> capacity;        // memory cudaMalloc may hand out
  std::optional<int64_t> allowed;         // set_fraction's limit (memory_fraction * capacity)
  int64_t gc_threshold_bytes = 0;         // garbage_collection_threshold * allowed
  bool gc_enabled = false;
};

// One recorded trace entry; device_free only for oom (which has no address).
using Recorder = std::function<void(Action, std::optional<int64_t> address, int64_t size, int64_t stream,
                                    const Frames& frames, int64_t device_free)>;
using SegmentAddresses = std::function<std::optional<int64_t>(int64_t size)>;

class CachingAllocator {
 public:
  explicit CachingAllocator(Settings settings);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // ------------------------------------------------------------------ the public API
  int64_t round_size(int64_t size) const;
  int64_t malloc(int64_t size, int64_t stream, const Frames& frames);
  void free(int64_t address, const Frames& frames);
  void request_free(int64_t address, const Frames& frames);
  void complete_free(int64_t address, const Frames& frames);
  void empty_cache(const Frames& frames) { release_cached_blocks(frames); }
  bool is_allocated(int64_t address) const { return active_.contains(address); }
  std::vector<std::pair<int64_t, bool>> cached_blocks(bool small, int64_t stream) const;
  // (free bytes, bytes in whole segments, largest block, blocks) of cached_blocks, in one pass.
  std::tuple<int64_t, int64_t, int64_t, int64_t> cached_summary(bool small, int64_t stream, bool pieces_only) const;
  std::optional<int64_t> segment_base(int64_t address) const;
  int64_t device_free() const;
  void restore_segment(int64_t address, int64_t total_size, int64_t stream, std::optional<bool> is_small,
                       std::vector<std::tuple<int64_t, int64_t, int64_t>> live_blocks);
  std::vector<Block*> segment_heads() const;
  std::string check_invariants() const;  // empty when consistent, else what is wrong

  const Settings& settings() const { return settings_; }

  bool record_history = true;
  Recorder recorder;
  SegmentAddresses segment_addresses;

  int64_t reserved_bytes = 0;
  int64_t allocated_bytes = 0;  // rounded sizes of active blocks (pending frees included)
  int64_t requested_bytes = 0;  // requested sizes of active blocks (pending frees included)
  int64_t peak_reserved_bytes = 0;
  int64_t peak_allocated_bytes = 0;
  int64_t segment_alloc_count = 0;
  int64_t segment_free_count = 0;
  int64_t segment_map_count = 0;
  int64_t segment_unmap_count = 0;
  int64_t alloc_retries = 0;
  int64_t oom_count = 0;

 private:
  // Whether entries are recorded: the frames a free records are looked at only then.
  bool recording() const { return record_history && static_cast<bool>(recorder); }
  int divisions_for(int64_t size) const;
  Block* take_active(int64_t address);
  void mark_freed(Block* block, const Frames& frames);
  void record(Action action, std::optional<int64_t> address, int64_t size, int64_t stream, const Frames& frames,
              int64_t device_free = 0);

  // the free index
  void insert_free(BlockPool& pool, Block* block);
  void remove_free(BlockPool& pool, Block* block);
  void insert_unmapped(BlockPool& pool, Block* block);
  void remove_unmapped(BlockPool& pool, Block* block);

  Block* get_free_block(BlockPool& pool, int64_t size, int64_t stream);
  bool should_split(const Block* block, int64_t size) const;
  int64_t alloc_found_block(BlockPool& pool, Block* block, int64_t size, int64_t requested, int64_t stream,
                            bool split, const Frames& frames);
  void free_block(Block* block, const Frames& frames);
  int64_t try_merge_blocks(BlockPool& pool, Block* dst, Block* src);

  // cudaMalloc / cudaFree
  Block* alloc_block(BlockPool& pool, int64_t size, int64_t alloc_size, int64_t stream, const Frames& frames);
  int64_t new_segment_address(int64_t size);
  bool overlaps(int64_t address, int64_t size) const;
  void add_span(int64_t address, int64_t size) { spans_.set(address, size); }
  void drop_span(int64_t address) { spans_.erase(address); }
  void claim_span(int64_t address, int64_t size);
  void release_block(BlockPool& pool, Block* block, const Frames& frames);
  bool release_available_cached_blocks(BlockPool& pool, int64_t size, int64_t stream, const Frames& frames);
  void release_cached_blocks(const Frames& frames);
  void garbage_collect_cached_blocks(const Frames& frames);

  // expandable segments
  Block* try_allocate_expandable_block(BlockPool& pool, int64_t size, int64_t stream, const Frames& frames);
  Block* find_expandable_block(BlockPool& pool, int64_t size, int64_t stream);
  bool map_block(BlockPool& pool, Block* block, int64_t size, const Frames& frames);
  void unmap_block(BlockPool& pool, Block* block, const Frames& frames);
  void release_expandable_segment(BlockPool& pool, Block* block);

  BlockPool& pool_of(const Block* block) { return block->is_small ? small_ : large_; }
  Block* make_block(int64_t address, int64_t size, int64_t stream, bool is_small);
  void destroy_block(Block* block);

  Settings settings_;
  int64_t max_split_;
  NodeMemory memory_;  // Blocks and set nodes; outlives the pools below
  BlockPool small_{true, &memory_};
  BlockPool large_{false, &memory_};
  size_t free_count_ = 0;                         // cached mapped blocks (in the pools' sets)
  std::unordered_map<int64_t, Block*> unmapped_;  // unmapped expandable blocks by address
  AddressMap<Block*> active_;                     // allocated or pending-free blocks by address
  std::vector<ExpandableSegment*> expandable_segments_;
  int64_t next_address_ = kDefaultBaseAddress;
  RangeMap spans_;  // live cudaMalloc ranges and VA reservations: start -> size
};

int64_t get_allocation_size(int64_t size);
int64_t roundup_power2_next_division(int64_t size, int64_t divisions);

}  // namespace memlens
