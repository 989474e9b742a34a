// The caching-allocator model: see caching_allocator.hpp. Each function names the upstream one
// (DeviceCachingAllocator in c10/cuda/CUDACachingAllocator.cpp) and the Python reference method
// (memlens/allocator/simulator.py) it follows; the order of the steps is theirs, so a trace
// replayed through either lands every block at the same address.
#include "caching_allocator.hpp"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <memory>
#include <tuple>

namespace memlens {

namespace {

int bit_length(int64_t value) { return value <= 0 ? 0 : 64 - __builtin_clzll(static_cast<uint64_t>(value)); }

int64_t align_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

int64_t ceil_div(int64_t value, int64_t divisor) { return (value + divisor - 1) / divisor; }

// Python truthiness of a frames object (``frames or block.frames``).
bool truthy(const Frames& frames) {
  if (!frames.is_valid()) return false;
  int result = PyObject_IsTrue(frames.ptr());
  if (result < 0) throw nanobind::python_error();
  return result == 1;
}

bool is_none(const Frames& frames) { return !frames.is_valid() || frames.is_none(); }

const Frames& either(const Frames& first, const Frames& second) { return truthy(first) ? first : second; }

int64_t expandable_size(const Block* block) {
  const Block* nxt = block->next;
  return block->size + (nxt != nullptr && !nxt->mapped ? nxt->size : 0);
}

bool allocatable(const Block* block) { return block != nullptr && !block->allocated && !block->pending; }

// The first block of at least ``size`` bytes (bisect_left of ``size << 64`` in the Python model).
FreeBlocks::iterator lower_bound_size(FreeBlocks& blocks, int64_t size) {
  return blocks.lower_bound(FreeEntry(size, INT64_MIN));
}

void check(bool condition, const char* what) {
  if (!condition) throw std::logic_error(std::string("allocator model invariant broken: ") + what);
}

}  // namespace

std::string hex(int64_t value) {
  char buffer[32];
  if (value < 0) {
    std::snprintf(buffer, sizeof buffer, "-0x%llx", static_cast<unsigned long long>(-(value + 1)) + 1ULL);
  } else {
    std::snprintf(buffer, sizeof buffer, "0x%llx", static_cast<unsigned long long>(value));
  }
  return buffer;
}

const char* action_name(Action action) {
  switch (action) {
    case Action::alloc: return "alloc";
    case Action::free_requested: return "free_requested";
    case Action::free_completed: return "free_completed";
    case Action::segment_alloc: return "segment_alloc";
    case Action::segment_free: return "segment_free";
    case Action::segment_map: return "segment_map";
    case Action::segment_unmap: return "segment_unmap";
    case Action::oom: return "oom";
  }
  return "?";
}

// get_allocation_size: the cudaMalloc size for a rounded request with no cached fit.
int64_t get_allocation_size(int64_t size) {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ceil_div(size, kRoundLarge);
}

// roundup_power2_next_division
int64_t roundup_power2_next_division(int64_t size, int64_t divisions) {
  if ((size & (size - 1)) == 0) return size;
  int64_t power2_floor = int64_t(1) << (bit_length(size) - 1);
  int64_t step = power2_floor >> (bit_length(divisions) - 1);
  if (step == 0) return power2_floor << 1;
  int64_t floor = size & ~(step - 1);
  return floor == size ? size : floor + step;
}

CachingAllocator::CachingAllocator(Settings settings) : settings_(std::move(settings)) {
  max_split_ = settings_.max_split_size.value_or(INT64_MAX);
  if (settings_.divisions.size() != static_cast<size_t>(kRoundupIntervals)) throw UsageError("roundup_power2_divisions needs 16 intervals");
}

CachingAllocator::~CachingAllocator() {
  for (BlockPool* pool : {&small_, &large_}) {
    for (auto& entry : pool->blocks) {
      for (Block* block : entry.second) destroy_block(block);
    }
  }
  for (auto& entry : unmapped_) destroy_block(entry.second);
  active_.for_each([this](int64_t, Block* block) { destroy_block(block); });
  for (ExpandableSegment* segment : expandable_segments_) delete segment;
}

Block* CachingAllocator::make_block(int64_t address, int64_t size, int64_t stream, bool is_small) {
  void* memory = memory_.allocate(sizeof(Block), alignof(Block));
  return new (memory) Block(address, size, stream, is_small);
}

void CachingAllocator::destroy_block(Block* block) {
  block->~Block();
  memory_.deallocate(block, sizeof(Block), alignof(Block));
}

// ================================================================== the public API
// round_size: 512-byte multiples, or power-of-2 divisions where configured.
int64_t CachingAllocator::round_size(int64_t size) const {
  if (size < kMinBlockSize) return kMinBlockSize;
  int64_t divisions = divisions_for(size);
  if (divisions > 1 && size > kMinBlockSize * divisions) return roundup_power2_next_division(size, divisions);
  return kMinBlockSize * ceil_div(size, kMinBlockSize);
}

// DeviceCachingAllocator::malloc: cached best fit, else cudaMalloc, else free-and-retry, else OOM.
int64_t CachingAllocator::malloc(int64_t size, int64_t stream, const Frames& frames) {
  if (size < 0) throw UsageError("cannot allocate a negative size (" + std::to_string(size) + ")");
  if (size > kMaxModelledRequest) {
    throw UsageError("cannot allocate " + std::to_string(size) +
                     " bytes: more than the allocator model covers (2**60)");
  }
  int64_t rounded = round_size(size);
  BlockPool& pool = rounded <= kSmallSize ? small_ : large_;
  int64_t alloc_size = get_allocation_size(rounded);

  Block* block = get_free_block(pool, rounded, stream);
  if (block == nullptr) {
    if (settings_.gc_enabled) garbage_collect_cached_blocks(frames);
    block = alloc_block(pool, rounded, alloc_size, stream, frames);
    if (block == nullptr && release_available_cached_blocks(pool, rounded, stream, frames)) {
      block = alloc_block(pool, rounded, alloc_size, stream, frames);
    }
    if (block == nullptr) {
      release_cached_blocks(frames);
      alloc_retries += 1;
      block = alloc_block(pool, rounded, alloc_size, stream, frames);
    }
    if (block == nullptr) {
      int64_t free_bytes = device_free();
      oom_count += 1;
      record(Action::oom, std::nullopt, rounded, stream, frames, free_bytes);
      throw OutOfMemory(size, rounded, free_bytes, allocated_bytes, reserved_bytes);
    }
  }
  bool split = should_split(block, rounded);
  return alloc_found_block(pool, block, rounded, size, stream, split, frames);
}

// Free at once: free_requested then free_completed.
void CachingAllocator::free(int64_t address, const Frames& frames) {
  Block* block = take_active(address);
  if (!block->pending) mark_freed(block, frames);
  free_block(block, frames);
}

// The caller freed it, but another stream may still use it (record_stream): not reusable yet.
void CachingAllocator::request_free(int64_t address, const Frames& frames) {
  Block* const* found = active_.find(address);
  if (found == nullptr || !(*found)->allocated) {
    throw UsageError("free of an address that is not allocated: " + hex(address));
  }
  mark_freed(*found, frames);
  (*found)->pending = true;
}

// The pending free is done (free_completed, process_events in upstream): back to the cache.
void CachingAllocator::complete_free(int64_t address, const Frames& frames) {
  Block* block = take_active(address);
  if (!block->pending) mark_freed(block, frames);
  free_block(block, frames);
}

std::vector<std::pair<int64_t, bool>> CachingAllocator::cached_blocks(bool small, int64_t stream) const {
  const BlockPool& pool = small ? small_ : large_;
  std::vector<std::pair<int64_t, bool>> result;
  auto found = pool.blocks.find(stream);
  if (found == pool.blocks.end()) return result;
  result.reserve(found->second.size());
  for (const Block* block : found->second) {
    result.emplace_back(block->size, !block->is_split() && block->expandable == nullptr);
  }
  return result;
}

std::tuple<int64_t, int64_t, int64_t, int64_t> CachingAllocator::cached_summary(bool small, int64_t stream,
                                                                                bool pieces_only) const {
  const BlockPool& pool = small ? small_ : large_;
  auto found = pool.blocks.find(stream);
  if (found == pool.blocks.end() || found->second.empty()) return {0, 0, 0, 0};
  const FreeBlocks& blocks = found->second;
  const FreeTotals& totals = blocks.totals;
  const auto count = static_cast<int64_t>(blocks.size());
  if (!pieces_only) return {totals.bytes, totals.whole_bytes, blocks.rbegin()->size, count};
  // Without the whole segments (once, at an OOM): the largest piece, from the largest block down.
  int64_t largest = 0;
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    if (!it->whole) {
      largest = it->size;
      break;
    }
  }
  return {totals.bytes - totals.whole_bytes, 0, largest, count - totals.whole_count};
}

std::optional<int64_t> CachingAllocator::segment_base(int64_t address) const {
  return spans_.start_of(address);
}

int64_t CachingAllocator::device_free() const {
  if (!settings_.capacity) return int64_t(1) << 62;
  return std::max<int64_t>(*settings_.capacity - reserved_bytes, 0);
}

// A segment that existed before the simulation began: live blocks as given, gaps cached.
void CachingAllocator::restore_segment(int64_t address, int64_t total_size, int64_t stream,
                                       std::optional<bool> is_small_given,
                                       std::vector<std::tuple<int64_t, int64_t, int64_t>> live_blocks) {
  bool is_small = is_small_given.value_or(total_size <= kSmallBuffer);
  if (total_size <= 0 || total_size % kMinBlockSize) {
    throw UsageError("segment size " + std::to_string(total_size) + " is not a positive multiple of 512");
  }
  if (address < 0 || total_size > kMaxModelledRequest || address > kMaxModelledAddress) {
    throw UsageError("segment " + hex(address) + "+" + std::to_string(total_size) +
                     " lies outside the address space the allocator model covers (0 to 2**62)");
  }
  claim_span(address, total_size);
  BlockPool& pool = is_small ? small_ : large_;
  std::vector<Block*> pieces;
  struct Pieces {  // pieces not yet handed to the indexes are returned if a live block does not fit
    CachingAllocator& owner;
    std::vector<Block*>& blocks;
    ~Pieces() {
      for (Block* piece : blocks) owner.destroy_block(piece);
    }
  } guard{*this, pieces};
  int64_t cursor = address;
  int64_t end = address + total_size;
  std::sort(live_blocks.begin(), live_blocks.end());
  for (const auto& [block_address, size, requested] : live_blocks) {
    if (block_address < cursor || size <= 0 || size > end - block_address) {
      throw UsageError("block " + hex(block_address) + "+" + std::to_string(size) + " does not fit segment " +
                       hex(address));
    }
    if (block_address > cursor) pieces.push_back(make_block(cursor, block_address - cursor, stream, is_small));
    Block* live = make_block(block_address, size, stream, is_small);
    live->allocated = true;
    live->requested_size = requested;
    pieces.push_back(live);
    cursor = block_address + size;
  }
  if (cursor < end) pieces.push_back(make_block(cursor, end - cursor, stream, is_small));
  for (size_t i = 0; i + 1 < pieces.size(); ++i) {
    pieces[i]->next = pieces[i + 1];
    pieces[i + 1]->prev = pieces[i];
  }
  std::vector<Block*> placed;
  placed.swap(pieces);  // the indexes own them from here
  for (Block* piece : placed) {
    if (piece->allocated) {
      active_.set(piece->address, piece);
      allocated_bytes += piece->size;
      requested_bytes += piece->requested_size;
    } else {
      insert_free(pool, piece);
    }
  }
  reserved_bytes += total_size;
  peak_reserved_bytes = std::max(peak_reserved_bytes, reserved_bytes);
  peak_allocated_bytes = std::max(peak_allocated_bytes, allocated_bytes);
}

std::vector<Block*> CachingAllocator::segment_heads() const {
  std::vector<Block*> heads;
  auto consider = [&heads](Block* block) {
    if (block->prev == nullptr || !block->prev->mapped) heads.push_back(block);
  };
  for (const BlockPool* pool : {&small_, &large_}) {
    for (const auto& entry : pool->blocks) {
      for (Block* block : entry.second) consider(block);
    }
  }
  active_.for_each([&consider](int64_t, Block* block) { consider(block); });
  std::sort(heads.begin(), heads.end(), ByAddress());
  return heads;
}

std::string CachingAllocator::check_invariants() const {
  int64_t reserved = 0, allocated = 0;
  std::set<int64_t> seen;
  for (const Block* head : segment_heads()) {
    const Block* block = head;
    int64_t cursor = head->address;
    while (block != nullptr && block->mapped) {
      if (block->address != cursor) return "gap or overlap at " + hex(cursor);
      if (!seen.insert(block->address).second) return "block seen twice at " + hex(block->address);
      if (block->allocated || block->pending) {
        Block* const* found = active_.find(block->address);
        if (found == nullptr || *found != block) return "active block not indexed";
        allocated += block->size;
      } else {
        const BlockPool& pool = block->is_small ? small_ : large_;
        auto found = pool.blocks.find(block->stream);
        if (found == pool.blocks.end() || found->second.count(const_cast<Block*>(block)) != 1) {
          return "free block not indexed";
        }
        const Block* nxt = block->next;
        if (nxt != nullptr && nxt->mapped && !(nxt->allocated || nxt->pending)) {
          return "two free neighbours at " + hex(block->address);
        }
      }
      reserved += block->size;
      cursor += block->size;
      block = block->next;
    }
  }
  if (reserved != reserved_bytes) return "reserved " + std::to_string(reserved) + " != " + std::to_string(reserved_bytes);
  if (allocated != allocated_bytes) return "allocated " + std::to_string(allocated) + " != " + std::to_string(allocated_bytes);
  if (seen.size() != active_.size() + free_count_) return "indexed blocks outside any segment";
  // The running sums match the cached blocks as they are now (whole or not, as cached_blocks says).
  for (const BlockPool* pool : {&small_, &large_}) {
    for (const auto& [stream, blocks] : pool->blocks) {
      FreeTotals now;
      for (const FreeEntry& entry : blocks) {
        if (entry.size != entry.block->size) return "a cached block's size changed in its set";
        if (entry.whole != (!entry.block->is_split() && entry.block->expandable == nullptr)) {
          return "a cached block's wholeness changed in its set";
        }
        now.add(entry, 1);
      }
      const FreeTotals& kept = blocks.totals;
      if (kept.bytes != now.bytes || kept.whole_bytes != now.whole_bytes || kept.whole_count != now.whole_count) {
        return "cached totals out of step";
      }
    }
  }
  return "";
}

// ================================================================== allocator internals
int CachingAllocator::divisions_for(int64_t size) const {
  int log_size = bit_length(size) - 1;
  int index = log_size > kRoundupIntervalStartLog2 ? log_size - kRoundupIntervalStartLog2 : 0;
  return static_cast<int>(settings_.divisions[std::min<int64_t>(index, kRoundupIntervals - 1)]);
}

Block* CachingAllocator::take_active(int64_t address) {
  Block* const* found = active_.find(address);
  if (found == nullptr) throw UsageError("free of an address that is not allocated: " + hex(address));
  Block* block = *found;
  active_.erase(address);
  return block;
}

void CachingAllocator::mark_freed(Block* block, const Frames& frames) {
  block->allocated = false;
  if (recording()) {
    record(Action::free_requested, block->address, block->requested_size, block->stream, either(frames, block->frames));
  }
}

void CachingAllocator::record(Action action, std::optional<int64_t> address, int64_t size, int64_t stream,
                              const Frames& frames, int64_t device_free_bytes) {
  if (!recording()) return;
  recorder(action, address, size, stream, frames, device_free_bytes);
}

// ------------------------------------------------------------------ the free index
void CachingAllocator::insert_free(BlockPool& pool, Block* block) {
  block->gc_base = pool.free_calls;
  FreeBlocks& cached = pool.stream_blocks(block->stream);
  auto [entry, inserted] = cached.insert(block);
  check(inserted, "insert_free of a block cached already");
  cached.totals.add(*entry, 1);
  free_count_ += 1;
}

void CachingAllocator::remove_free(BlockPool& pool, Block* block) {
  auto found = pool.blocks.find(block->stream);
  check(found != pool.blocks.end(), "remove_free of a block not cached");
  auto entry = found->second.find(block);
  check(entry != found->second.end() && entry->block == block, "remove_free of a block not cached");
  found->second.totals.add(*entry, -1);
  found->second.erase(entry);
  free_count_ -= 1;
}

void CachingAllocator::insert_unmapped(BlockPool& pool, Block* block) {
  unmapped_[block->address] = block;
  pool.stream_unmapped(block->stream).insert(block);
}

void CachingAllocator::remove_unmapped(BlockPool& pool, Block* block) {
  auto found = pool.unmapped.find(block->stream);
  check(found != pool.unmapped.end() && found->second.erase(block) == 1, "remove_unmapped of a mapped block");
  unmapped_.erase(block->address);
}

// ------------------------------------------------------------------ get_free_block
Block* CachingAllocator::get_free_block(BlockPool& pool, int64_t size, int64_t stream) {
  if (settings_.gc_enabled) pool.free_calls += 1;
  auto found = pool.blocks.find(stream);
  if (found == pool.blocks.end() || found->second.empty()) return nullptr;
  FreeBlocks& blocks = found->second;
  auto it = lower_bound_size(blocks, size);
  if (it == blocks.end()) return nullptr;
  Block* block = *it;
  if (block->expandable != nullptr) {
    if (settings_.expandable_segments) {
      // Best fit counts the unmapped space after a block as room it can grow into.
      int64_t best = expandable_size(block);
      while (block->expandable != nullptr && std::next(it) != blocks.end()) {
        Block* candidate = *std::next(it);
        int64_t candidate_size = expandable_size(candidate);
        if (candidate_size >= best) break;
        ++it;
        block = candidate;
        best = candidate_size;
      }
    } else {
      // Expandable segments were switched off: only plain blocks qualify.
      ++it;
      while (it != blocks.end() && it->block->expandable != nullptr) ++it;
      if (it == blocks.end()) return nullptr;
      block = *it;
    }
  }
  // Do not return an oversized block for a request below max_split_size ...
  if (size < max_split_ && block->size >= max_split_) return nullptr;
  // ... and let an oversize request round up by at most kLargeBuffer.
  if (size >= max_split_ && block->size >= size + kLargeBuffer) return nullptr;
  blocks.totals.add(*it, -1);
  blocks.erase(it);
  free_count_ -= 1;
  return block;
}

// should_split
bool CachingAllocator::should_split(const Block* block, int64_t size) const {
  int64_t remaining = block->size - size;
  if (block->is_small || settings_.expandable_segments) return remaining >= kMinBlockSize;
  return size < max_split_ && remaining > kSmallSize;
}

// alloc_found_block: the old Block object becomes the cached remainder, as in PyTorch.
int64_t CachingAllocator::alloc_found_block(BlockPool& pool, Block* block, int64_t size, int64_t requested,
                                            int64_t stream, bool split, const Frames& frames) {
  if (split) {
    Block* remaining = block;
    block = make_block(remaining->address, size, stream, remaining->is_small);
    block->expandable = remaining->expandable;
    block->prev = remaining->prev;
    if (block->prev != nullptr) block->prev->next = block;
    block->next = remaining;
    block->segment_frames = remaining->segment_frames;
    remaining->segment_frames = Frames();
    remaining->prev = block;
    remaining->address += size;
    remaining->size -= size;
    insert_free(pool, remaining);
  }
  block->allocated = true;
  block->pending = false;
  block->requested_size = requested;
  block->frames = frames;
  active_.set(block->address, block);
  allocated_bytes += block->size;
  requested_bytes += requested;
  if (allocated_bytes > peak_allocated_bytes) peak_allocated_bytes = allocated_bytes;
  record(Action::alloc, block->address, requested, block->stream, frames);
  return block->address;
}

// ------------------------------------------------------------------ free_block
void CachingAllocator::free_block(Block* block, const Frames& frames) {
  block->allocated = false;
  block->pending = false;
  if (recording()) {
    record(Action::free_completed, block->address, block->requested_size, block->stream, either(frames, block->frames));
  }
  block->frames = Frames();
  allocated_bytes -= block->size;
  requested_bytes -= block->requested_size;
  BlockPool& pool = pool_of(block);
  try_merge_blocks(pool, block, block->prev);
  try_merge_blocks(pool, block, block->next);
  insert_free(pool, block);
}

// try_merge_blocks: ``src`` is absorbed into ``dst`` and deleted.
int64_t CachingAllocator::try_merge_blocks(BlockPool& pool, Block* dst, Block* src) {
  if (src == nullptr || src->allocated || src->pending || src->mapped != dst->mapped) return 0;
  if (src->mapped) {
    remove_free(pool, src);
  } else {
    remove_unmapped(pool, src);
  }
  if (dst->prev == src) {  // [src dst]
    dst->address = src->address;
    dst->prev = src->prev;
    if (dst->prev != nullptr) dst->prev->next = dst;
    dst->segment_frames = src->segment_frames;
  } else {  // [dst src]
    dst->next = src->next;
    if (dst->next != nullptr) dst->next->prev = dst;
  }
  int64_t subsumed = src->size;
  dst->size += subsumed;
  destroy_block(src);
  return subsumed;
}

// ------------------------------------------------------------------ cudaMalloc / cudaFree
// alloc_block
Block* CachingAllocator::alloc_block(BlockPool& pool, int64_t size, int64_t alloc_size, int64_t stream,
                                     const Frames& frames) {
  if (settings_.allowed && reserved_bytes + alloc_size > *settings_.allowed) return nullptr;
  if (settings_.expandable_segments) return try_allocate_expandable_block(pool, size, stream, frames);
  if (settings_.capacity && reserved_bytes + alloc_size > *settings_.capacity) return nullptr;
  int64_t address = new_segment_address(alloc_size);
  Block* block = make_block(address, alloc_size, stream, pool.is_small);
  block->segment_frames = frames;
  add_span(address, alloc_size);
  reserved_bytes += alloc_size;
  if (reserved_bytes > peak_reserved_bytes) peak_reserved_bytes = reserved_bytes;
  segment_alloc_count += 1;
  record(Action::segment_alloc, address, alloc_size, stream, frames);
  return block;
}

int64_t CachingAllocator::new_segment_address(int64_t size) {
  if (segment_addresses) {
    std::optional<int64_t> hinted = segment_addresses(size);
    // A hint outside the modelled address space (no real cudaMalloc returns one) is not taken.
    if (hinted && *hinted >= 0 && *hinted <= kMaxModelledAddress && !overlaps(*hinted, size)) {
      next_address_ = std::max(next_address_, align_up(*hinted + size, kSegmentAlignment));
      return *hinted;
    }
  }
  int64_t address = next_address_;
  while (overlaps(address, size)) address = align_up(address + size, kSegmentAlignment);
  next_address_ = align_up(address + size, kSegmentAlignment);
  return address;
}

bool CachingAllocator::overlaps(int64_t address, int64_t size) const { return spans_.overlaps(address, size); }

void CachingAllocator::claim_span(int64_t address, int64_t size) {
  if (overlaps(address, size)) {
    throw UsageError("segment " + hex(address) + "+" + std::to_string(size) + " overlaps an existing segment");
  }
  add_span(address, size);
  next_address_ = std::max(next_address_, align_up(address + size, kSegmentAlignment));
}

// release_block: cudaFree of a whole, unsplit, cached segment.
void CachingAllocator::release_block(BlockPool& pool, Block* block, const Frames& frames) {
  remove_free(pool, block);
  drop_span(block->address);
  reserved_bytes -= block->size;
  segment_free_count += 1;
  record(Action::segment_free, block->address, block->size, block->stream, either(frames, block->segment_frames));
  destroy_block(block);
}

// release_available_cached_blocks: free oversize cached blocks, only as many as the request needs.
bool CachingAllocator::release_available_cached_blocks(BlockPool& pool, int64_t size, int64_t stream,
                                                       const Frames& frames) {
  if (!settings_.max_split_size) return false;
  auto found = pool.blocks.find(stream);
  if (found == pool.blocks.end()) return false;
  FreeBlocks& blocks = found->second;
  int64_t target = std::max(size, max_split_);
  auto it = lower_bound_size(blocks, target);
  if (it != blocks.end()) {
    Block* block = *it;
    if (block->expandable != nullptr || block->is_split()) return false;
    release_block(pool, block, frames);
    return true;
  }
  int64_t released = 0;
  // No single block is big enough: free the largest oversize ones until enough is freed.
  std::vector<Block*> largest_first(blocks.rbegin(), blocks.rend());
  for (Block* block : largest_first) {
    if (released >= target) break;
    if (block->size < max_split_) break;
    if (block->expandable != nullptr || block->is_split()) continue;
    released += block->size;
    release_block(pool, block, frames);
  }
  return released >= target;
}

// release_cached_blocks (empty_cache): every unsplit cached segment, and the free pages of expandable ones.
void CachingAllocator::release_cached_blocks(const Frames& frames) {
  for (BlockPool* pool : {&large_, &small_}) {
    std::vector<Block*> to_unmap;
    for (auto& [stream, blocks] : pool->blocks) {
      std::vector<Block*> cached(blocks.begin(), blocks.end());
      for (Block* block : cached) {
        if (block->expandable != nullptr) {
          to_unmap.push_back(block);
        } else if (!block->is_split()) {
          release_block(*pool, block, frames);
        }
      }
    }
    for (Block* block : to_unmap) {
      unmap_block(*pool, block, frames);
      if (block->prev == nullptr && block->next == nullptr) release_expandable_segment(*pool, block);
    }
  }
}

// garbage_collect_cached_blocks: free old unsplit large cached blocks until reserved drops below the threshold.
void CachingAllocator::garbage_collect_cached_blocks(const Frames& frames) {
  int64_t gc_threshold = settings_.gc_threshold_bytes;
  if (reserved_bytes <= gc_threshold) return;
  int64_t target = reserved_bytes - gc_threshold;
  BlockPool& pool = large_;
  int64_t total_age = 0, count = 0;
  for (auto& [stream, blocks] : pool.blocks) {
    for (Block* block : blocks) {
      if (!block->is_split()) {
        total_age += pool.free_calls - block->gc_base;
        count += 1;
      }
    }
  }
  if (count == 0) return;
  int64_t reclaimed = 0;
  bool block_freed = true;
  while (reclaimed < target && block_freed && count > 0) {
    // The Python model divides two ints into a float, as upstream's double: the same threshold.
    double age_threshold = static_cast<double>(total_age) / static_cast<double>(count);
    block_freed = false;
    for (auto& [stream, blocks] : pool.blocks) {
      std::vector<Block*> cached(blocks.begin(), blocks.end());
      for (Block* block : cached) {
        int64_t age = pool.free_calls - block->gc_base;
        if (!block->is_split() && block->expandable == nullptr && static_cast<double>(age) >= age_threshold) {
          block_freed = true;
          reclaimed += block->size;
          total_age -= age;
          count -= 1;
          release_block(pool, block, frames);
        }
      }
    }
  }
}

// ------------------------------------------------------------------ expandable segments
Block* CachingAllocator::try_allocate_expandable_block(BlockPool& pool, int64_t size, int64_t stream,
                                                       const Frames& frames) {
  Block* candidate = find_expandable_block(pool, size, stream);
  if (!candidate->mapped && !map_block(pool, candidate, std::min(candidate->size, size), frames)) return nullptr;
  while (candidate->size < size) {
    Block* nxt = candidate->next;
    check(nxt != nullptr && !nxt->mapped, "an expandable block grows into unmapped pages");
    if (!map_block(pool, nxt, std::min(size - candidate->size, nxt->size), frames)) return nullptr;
    candidate = nxt;
  }
  remove_free(pool, candidate);
  return candidate;
}

Block* CachingAllocator::find_expandable_block(BlockPool& pool, int64_t size, int64_t stream) {
  auto found = pool.unmapped.find(stream);
  if (found != pool.unmapped.end()) {
    for (Block* unmapped : found->second) {
      Block* candidate = unmapped;
      if (allocatable(candidate->prev)) candidate = candidate->prev;
      int64_t room = 0;
      Block* probe = candidate;
      while (room < size && allocatable(probe)) {
        room += probe->size;
        probe = probe->next;
      }
      if (room >= size) return candidate;
    }
  }
  int64_t page = pool.is_small ? kSmallBuffer : kLargeBuffer;
  int64_t device_memory = settings_.capacity ? *settings_.capacity : std::max(kDefaultDeviceMemory, size);
  int64_t handles = ceil_div(device_memory + device_memory / 8, page);
  int64_t va_size = handles * page;
  int64_t base = new_segment_address(va_size);
  add_span(base, va_size);
  auto* segment = new ExpandableSegment{base, page, va_size, stream};
  expandable_segments_.push_back(segment);
  Block* block = make_block(base, va_size, stream, pool.is_small);
  block->mapped = false;
  block->expandable = segment;
  insert_unmapped(pool, block);
  return block;
}

// map_block: map the pages under the first ``size`` bytes of an unmapped block.
bool CachingAllocator::map_block(BlockPool& pool, Block* block, int64_t size, const Frames& frames) {
  ExpandableSegment* segment = block->expandable;
  check(segment != nullptr && !block->mapped && size <= block->size, "map_block of a mapped block");
  int64_t offset = block->address - segment->base;
  int64_t end = ceil_div(offset + size, segment->page_size) * segment->page_size;
  int64_t mapped = end - offset;
  if (settings_.capacity && reserved_bytes + mapped > *settings_.capacity) return false;
  remove_unmapped(pool, block);
  block->mapped = true;
  if (mapped < block->size) {
    Block* remaining = make_block(block->address + mapped, block->size - mapped, block->stream, block->is_small);
    remaining->mapped = false;
    remaining->expandable = segment;
    remaining->prev = block;
    remaining->next = block->next;
    if (block->next != nullptr) block->next->prev = remaining;
    block->next = remaining;
    insert_unmapped(pool, remaining);
    block->size = mapped;
  }
  int64_t mapped_address = block->address;
  try_merge_blocks(pool, block, block->prev);
  try_merge_blocks(pool, block, block->next);
  insert_free(pool, block);
  reserved_bytes += mapped;
  if (reserved_bytes > peak_reserved_bytes) peak_reserved_bytes = reserved_bytes;
  segment_map_count += 1;
  record(Action::segment_map, mapped_address, mapped, block->stream, frames);
  if (block->prev == nullptr && is_none(block->segment_frames)) block->segment_frames = frames;
  return true;
}

// unmap_block: unmap the whole pages of a cached expandable block; the partial ends stay cached.
void CachingAllocator::unmap_block(BlockPool& pool, Block* block, const Frames& frames) {
  ExpandableSegment* segment = block->expandable;
  check(segment != nullptr, "unmap_block of a plain block");
  int64_t page = segment->page_size;
  int64_t offset = block->address - segment->base;
  int64_t begin = ceil_div(offset, page) * page;
  int64_t end = ((offset + block->size) / page) * page;
  if (begin >= end) return;
  remove_free(pool, block);
  int64_t unmapped_address = segment->base + begin;
  int64_t unmapped_size = end - begin;
  int64_t before = unmapped_address - block->address;
  if (before > 0) {
    Block* before_free = make_block(block->address, before, block->stream, block->is_small);
    before_free->expandable = segment;
    before_free->prev = block->prev;
    if (block->prev != nullptr) block->prev->next = before_free;
    before_free->next = block;
    block->prev = before_free;
    insert_free(pool, before_free);
  }
  int64_t after = block->size - before - unmapped_size;
  if (after > 0) {
    Block* after_free = make_block(unmapped_address + unmapped_size, after, block->stream, block->is_small);
    after_free->expandable = segment;
    after_free->next = block->next;
    if (block->next != nullptr) block->next->prev = after_free;
    after_free->prev = block;
    block->next = after_free;
    insert_free(pool, after_free);
  }
  block->address = unmapped_address;
  block->size = unmapped_size;
  block->mapped = false;
  try_merge_blocks(pool, block, block->prev);
  try_merge_blocks(pool, block, block->next);
  insert_unmapped(pool, block);
  reserved_bytes -= unmapped_size;
  segment_unmap_count += 1;
  record(Action::segment_unmap, unmapped_address, unmapped_size, block->stream, either(frames, block->segment_frames));
}

void CachingAllocator::release_expandable_segment(BlockPool& pool, Block* block) {
  ExpandableSegment* segment = block->expandable;
  check(segment != nullptr && block->size == segment->size && !block->mapped, "release of a partly mapped segment");
  remove_unmapped(pool, block);
  expandable_segments_.erase(std::find(expandable_segments_.begin(), expandable_segments_.end(), segment));
  drop_span(segment->base);
  destroy_block(block);
  delete segment;
}

}  // namespace memlens
