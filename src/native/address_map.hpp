// AddressMap: the hash map keyed by address that the allocator model (caching_allocator.hpp) and
// the snapshot's kernels (snapshot_kernels.cpp) both keep their per-address state in.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace memlens {

// A hash map keyed by address: open addressing with linear probing and backward-shift deletion,
// so a lookup reads one or two adjacent slots instead of chasing std::unordered_map's nodes (the
// replay looks an address up three or four times per event). Iteration order is the slots';
// nothing that iterates one depends on it (the segment heads are sorted afterwards).
template <typename Value>
class AddressMap {
 public:
  AddressMap() { rehash(16); }

  size_t size() const { return size_; }

  Value* find(int64_t key) {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      Slot& slot = slots_[i];
      if (!slot.used) return nullptr;
      if (slot.key == key) return &slot.value;
    }
  }
  const Value* find(int64_t key) const { return const_cast<AddressMap*>(this)->find(key); }
  bool contains(int64_t key) const { return find(key) != nullptr; }

  void set(int64_t key, Value value) {  // insert, or replace the value held under key
    if (Value* held = find(key)) {
      *held = value;
      return;
    }
    if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);
    place(key, value);
    size_ += 1;
  }

  bool erase(int64_t key) {
    size_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      if (!slots_[i].used) return false;
      if (slots_[i].key == key) break;
    }
    // Backward shift: pull each later slot of the run that may sit at ``i`` into the hole.
    for (size_t j = (i + 1) & mask_; slots_[j].used; j = (j + 1) & mask_) {
      size_t wanted = home(slots_[j].key);
      bool stays = i <= j ? (i < wanted && wanted <= j) : (i < wanted || wanted <= j);
      if (stays) continue;
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i].used = false;
    size_ -= 1;
    return true;
  }

  template <typename Visit>
  void for_each(Visit&& visit) const {
    for (const Slot& slot : slots_) {
      if (slot.used) visit(slot.key, slot.value);
    }
  }

 private:
  struct Slot {
    int64_t key = 0;
    Value value{};
    bool used = false;
  };

  size_t home(int64_t key) const {  // Fibonacci hashing: the high bits of the product
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ULL) >> shift_);
  }

  void place(int64_t key, Value value) {
    size_t i = home(key);
    while (slots_[i].used) i = (i + 1) & mask_;
    slots_[i].key = key;
    slots_[i].value = value;
    slots_[i].used = true;
  }

  void rehash(size_t capacity) {  // capacity: a power of two
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    shift_ = 64;
    for (size_t c = capacity; c > 1; c >>= 1) shift_ -= 1;
    for (const Slot& slot : old) {
      if (slot.used) place(slot.key, slot.value);
    }
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
  size_t mask_ = 0;
  int shift_ = 64;
};

}  // namespace memlens
