// The snapshot scanner (see pickle_scan.hpp): CPython's unpickler semantics for the opcodes a memory
// snapshot uses, the Python vetting's limits, and the trace columns.
#include "pickle_scan.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>

namespace memlens::scan {

std::string_view Arena::text(const Value& value) const {
  const StrRef& ref = strings.at(static_cast<size_t>(value.num));
  return std::string_view(reinterpret_cast<const char*>(ref.bytes), ref.length);
}

const uint8_t* TextPool::add(const uint8_t* bytes, size_t length) {
  static constexpr uint8_t kEmpty[1] = {0};
  if (length == 0) return kEmpty;
  uint8_t* at = nullptr;
  if (length > kBlock / 4) {
    long_.emplace_back(new uint8_t[length]);
    at = long_.back().get();
  } else {
    if (length > room_) {
      blocks_.emplace_back(new uint8_t[kBlock]);
      room_ = kBlock;
    }
    at = blocks_.back().get() + (kBlock - room_);
    room_ -= length;
  }
  std::memcpy(at, bytes, length);
  stored_ += length;
  return at;
}

namespace {

struct Declined {
  std::string reason;
};

// UTF-8 as Python's pickle decodes it ('surrogatepass': encoded surrogates are accepted).
bool valid_utf8(const uint8_t* text, size_t length) {
  size_t i = 0;
  while (i < length) {
    const uint8_t lead = text[i];
    size_t extra = 0;
    uint32_t point = 0;
    if (lead < 0x80) {
      ++i;
      continue;
    } else if (lead >= 0xC2 && lead <= 0xDF) {
      extra = 1;
      point = lead & 0x1F;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      extra = 2;
      point = lead & 0x0F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      extra = 3;
      point = lead & 0x07;
    } else {
      return false;
    }
    if (extra > length - i - 1) return false;
    for (size_t k = 1; k <= extra; ++k) {
      const uint8_t next = text[i + k];
      if ((next & 0xC0) != 0x80) return false;
      point = (point << 6) | (next & 0x3F);
    }
    if ((extra == 2 && point < 0x800) || (extra == 3 && (point < 0x10000 || point > 0x10FFFF))) return false;
    i += extra + 1;
  }
  return true;
}

// The entry field a key string names, compared once per string read (not per entry).
Field field_named(const uint8_t* text, size_t length) {
  struct Named {
    std::string_view name;
    Field field;
  };
  static constexpr Named kFields[] = {
      {"action", Field::Action}, {"addr", Field::Addr}, {"size", Field::Size}, {"stream", Field::Stream},
      {"time_us", Field::TimeUs}, {"frames", Field::Frames}, {"device_free", Field::DeviceFree},
      {"user_metadata", Field::UserMetadata}, {"compile_context", Field::CompileContext}};
  if (length < 4 || length > 15) return Field::None;
  for (const Named& named : kFields) {
    if (named.name.size() == length && std::memcmp(named.name.data(), text, length) == 0) return named.field;
  }
  return Field::None;
}

// An arena index (a string's or a container's) to an id: open addressing, a power-of-two table at
// most half full. std::unordered_map's lookup (a division, a node per entry) was most of a row's time.
class IndexMap {
 public:
  // The id of `key`, or -1.
  int32_t find(int64_t key) const {
    if (slots_.empty()) return -1;
    for (size_t at = slot(key);; at = (at + 1) & mask_) {
      const Slot& entry = slots_[at];
      if (entry.id < 0) return -1;
      if (entry.key == key) return entry.id;
    }
  }
  void insert(int64_t key, int32_t id) {  // key not yet in the map
    if (2 * (used_ + 1) > slots_.size()) grow();
    size_t at = slot(key);
    while (slots_[at].id >= 0) at = (at + 1) & mask_;
    slots_[at] = Slot{key, id};
    ++used_;
  }

 private:
  struct Slot {
    int64_t key = 0;
    int32_t id = -1;
  };
  size_t slot(int64_t key) const {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> 32) & mask_;
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(old.empty() ? 64 : 2 * old.size(), Slot{});
    mask_ = slots_.size() - 1;
    used_ = 0;
    for (const Slot& entry : old) {
      if (entry.id >= 0) insert(entry.key, entry.id);
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t used_ = 0;
};

// Interning by content (strings) or by identity (frames lists), in order of first appearance.
class Distinct {
 public:
  explicit Distinct(int32_t tag = -1) : tag_(tag) {}

  // By content; the string object is looked up first (rows share memoised strings: the object
  // remembers its id in the table that interned it last), its text hashed only once per object.
  int32_t text(Arena& arena, const Value& value, std::vector<Value>& table) {
    StrRef& ref = arena.strings.at(static_cast<size_t>(value.num));
    if (ref.interned.table == tag_ && tag_ >= 0) return ref.interned.id;
    int32_t id = by_string_.find(value.num);
    if (id < 0) {
      const std::string_view key = arena.text(value);
      auto found = by_text_.find(key);
      if (found != by_text_.end()) {
        id = found->second;
      } else {
        table.push_back(value);
        id = static_cast<int32_t>(table.size() - 1);
        by_text_.emplace(key, id);
      }
      by_string_.insert(value.num, id);
    }
    ref.interned = Interned{tag_, id};
    return id;
  }
  int32_t none(std::vector<Value>& table) {
    if (none_ < 0) {
      table.push_back(Value{Kind::None, 0});
      none_ = static_cast<int32_t>(table.size() - 1);
    }
    return none_;
  }
  int32_t identity(Arena& arena, const Value& value, std::vector<Value>& table) {
    Container& object = arena.containers.at(static_cast<size_t>(value.num));
    if (object.interned.table == tag_ && tag_ >= 0) return object.interned.id;
    int32_t id = by_index_.find(value.num);
    if (id < 0) {
      table.push_back(value);
      id = static_cast<int32_t>(table.size() - 1);
      by_index_.insert(value.num, id);
    }
    object.interned = Interned{tag_, id};
    return id;
  }

 private:
  std::unordered_map<std::string_view, int32_t> by_text_;
  int32_t tag_;  // this table's number among all lists' tables (-1: none)
  IndexMap by_string_;
  IndexMap by_index_;
  int32_t none_ = -1;
};

// The interning state of one list's columns while its entries are read.
struct Interning {
  // `first_tag`: the first of four table numbers never used before (an object's remembered id is
  // only read back by the table that wrote it, so a discarded table's ids are never read).
  explicit Interning(int32_t first_tag = -1)
      : actions(first_tag), frames(first_tag < 0 ? -1 : first_tag + 1), metadata(first_tag < 0 ? -1 : first_tag + 2),
        context(first_tag < 0 ? -1 : first_tag + 3) {}
  Distinct actions, frames, metadata, context;
};

constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();

// The fields of one entry the reader reads (the last of a repeated key wins, as in a dict).
struct EntryFields {
  const Value* action = nullptr;
  const Value* addr = nullptr;
  const Value* size = nullptr;
  const Value* stream = nullptr;
  const Value* time_us = nullptr;
  const Value* frames = nullptr;
  const Value* device_free = nullptr;
  const Value* user_metadata = nullptr;
  const Value* compile_context = nullptr;
};

EntryFields fields_of(const Arena& arena, const Container& entry) {
  EntryFields fields;
  const size_t keys = entry.items.size() & ~size_t{1};  // a dict's items come in pairs
  for (size_t k = 0; k < keys; k += 2) {
    const Value& key = entry.items[k];
    if (key.kind != Kind::Str) continue;
    const Value* value = &entry.items[k + 1];
    switch (arena.strings.at(static_cast<size_t>(key.num)).field) {
      case Field::Action: fields.action = value; break;
      case Field::Addr: fields.addr = value; break;
      case Field::Size: fields.size = value; break;
      case Field::Stream: fields.stream = value; break;
      case Field::TimeUs: fields.time_us = value; break;
      case Field::Frames: fields.frames = value; break;
      case Field::DeviceFree: fields.device_free = value; break;
      case Field::UserMetadata: fields.user_metadata = value; break;
      case Field::CompileContext: fields.compile_context = value; break;
      case Field::None: break;
    }
  }
  return fields;
}

// An integer field: missing is 0; a 64-bit value keeps its bits; anything else declines.
bool int_field(const Value* value, bool allow_uint64, int64_t low, int64_t& out) {
  if (value == nullptr) {
    out = 0;
    return true;
  }
  if (value->kind == Kind::Int && value->num >= low) {
    out = value->num;
    return true;
  }
  if (value->kind == Kind::UInt64 && allow_uint64) {
    out = value->num;
    return true;
  }
  return false;
}

bool text_or_none(Arena& arena, Distinct& distinct, const Value* value, std::vector<Value>& table,
                  LazyColumn<int32_t>& local) {
  if (value == nullptr || value->kind == Kind::None) {
    local.push(distinct.none(table));
    return true;
  }
  if (value->kind != Kind::Str) return false;
  local.push(distinct.text(arena, *value, table));
  return true;
}

// One entry as the next row of its list's columns, or false when it is not plain (the Python
// checker would count its sharing, or a field is of a type or value the columns do not hold).
// On false the columns hold part of the row: the caller drops them, or declines the file.
bool add_row(Arena& arena, const Value& item, TraceColumns& out, Interning& interning) {
  if (item.kind != Kind::Dict) return false;
  const Container& entry = arena.container(item);
  if (entry.refs != 1 || entry.row) return false;  // met elsewhere too: the Python checker counts such sharing
  const EntryFields f = fields_of(arena, entry);
  if (out.rows == 0) {
    out.first_entry = item;
    out.has_time = f.time_us != nullptr;
  }
  if (f.action == nullptr || f.action->kind != Kind::Str) return false;
  int64_t addr = 0, size = 0, stream = 0, time_us = 0;
  if (!int_field(f.addr, true, kInt64Min, addr) || !int_field(f.size, true, 0, size) ||
      !int_field(f.stream, true, kInt64Min, stream) || !int_field(f.time_us, false, kInt64Min, time_us)) {
    return false;
  }
  const int32_t action = interning.actions.text(arena, *f.action, out.actions);
  if (static_cast<size_t>(action) >= kMaxActions) return false;  // the action column is a byte a row
  if (static_cast<size_t>(action) == out.action_is_oom.size()) out.action_is_oom.push_back(arena.text(*f.action) == "oom");
  int64_t device_free = 0;
  if (out.action_is_oom.at(static_cast<size_t>(action)) && f.device_free != nullptr && f.device_free->kind != Kind::None) {
    // A size_t, refused when negative, read as unknown past PLAUSIBLE_BYTES: the Python path does both.
    if (f.device_free->kind != Kind::Int || f.device_free->num < 0 || f.device_free->num > kPlausibleBytes) {
      return false;
    }
    device_free = f.device_free->num;
  }
  int32_t frames = 0;
  if (f.frames == nullptr || f.frames->kind == Kind::None) {
    frames = interning.frames.none(out.frames);
  } else if (f.frames->kind == Kind::List) {
    frames = interning.frames.identity(arena, *f.frames, out.frames);
  } else {
    return false;
  }
  out.has_user_metadata |= f.user_metadata != nullptr;
  out.has_compile_context |= f.compile_context != nullptr;
  if (!text_or_none(arena, interning.metadata, f.user_metadata, out.metadata, out.metadata_local) ||
      !text_or_none(arena, interning.context, f.compile_context, out.context, out.context_local)) {
    return false;
  }
  out.action_local.push_back(static_cast<uint8_t>(action));
  out.addr.push_back(addr);
  out.size.push_back(size);
  out.stream.push(stream);
  out.time_us.push(time_us);
  out.device_free.push(device_free);
  out.frames_local.push_back(frames);
  ++out.rows;
  return true;
}

// What an opcode was, for the tuple rule: a tuple's items must be the scalar opcodes just before it.
enum class Token : uint8_t { Other, SmallItem, WideItem, Mark };

class Machine {
 public:
  // The whole input in memory: the window is all of it.
  Machine(const uint8_t* data, size_t size) : window_(data), window_end_(size), size_(size) { reserve(); }
  // The input read a window of `chunk` bytes at a time.
  Machine(ReadAt read, size_t size, size_t chunk)
      : size_(size), read_(std::move(read)), chunk_(std::max<size_t>(chunk, 1)) {
    reserve();
  }

  Arena run() {
    while (true) {
      const size_t at = pos_;
      const uint8_t op = byte();
      if (step(op, at)) break;
    }
    arena_.root = pop();
    return std::move(arena_);
  }

 private:
  [[noreturn]] static void decline(std::string reason) { throw Declined{std::move(reason)}; }

  void reserve() {
    // Room for what a snapshot of this size holds (a memo entry per 64 bytes, as PyTorch writes
    // them; at most 16M ahead of need): no copies of the growing memo, no pages faulted twice.
    // Only the touched part of a reservation costs memory. Containers are reused once their entry
    // is a row, so a snapshot needs few more than its frames and segments.
    const size_t expected = std::min(size_ / 64, size_t{1} << 24);
    arena_.containers.reserve(std::min(expected, size_t{1} << 16));
    memo_.reserve(expected);
  }

  // The next n bytes exist (pos_ + n <= size_, computed without overflow), and do not run past
  // the end of the frame they start in: CPython's unpickler, reading a file, holds a frame in a
  // buffer and reads what runs past its end afresh from the file, dropping the frame's rest
  // (pickle.loads of the same bytes would not); PyTorch's pickler never writes such a stream.
  void check_room(size_t n) const {
    if (n > size_ - pos_) decline("truncated");
    if (pos_ < frame_end_ && n > frame_end_ - pos_) decline("an opcode across a frame's end");
  }
  // As check_room, and the n bytes are in the window: bytes_at(pos_) reads them until the next need().
  void need(size_t n) {
    check_room(n);
    if (n > window_end_ - pos_) fill(n);
  }
  const uint8_t* bytes_at(size_t pos) const { return window_ + (pos - window_start_); }
  // Moves the window to start at pos_ and hold at least n bytes (need checked they exist), reading
  // a chunk more while it is at it: the bytes before pos_ are never read again.
  void fill(size_t n) {
    if (!read_) decline("truncated");  // the whole input is the window already
    const size_t kept = window_end_ - pos_;
    const size_t target = std::min(std::max(n, chunk_), size_ - pos_);
    if (buffer_.size() < target) {
      std::vector<uint8_t> larger(target);
      if (kept > 0) std::memcpy(larger.data(), bytes_at(pos_), kept);
      buffer_.swap(larger);
    } else if (kept > 0) {
      std::memmove(buffer_.data(), bytes_at(pos_), kept);
    }
    window_ = buffer_.data();
    window_start_ = pos_;
    window_end_ = pos_ + kept;
    while (window_end_ - pos_ < target) {
      const size_t wanted = target - (window_end_ - pos_);
      const size_t got = read_(window_end_, buffer_.data() + (window_end_ - pos_), wanted);
      // The input ended before the size it had when opened: the Python path says what it is now.
      if (got == 0 || got > wanted) decline("truncated");
      window_end_ += got;
    }
  }
  uint8_t byte() {
    need(1);
    return *bytes_at(pos_++);
  }
  uint64_t little(size_t width) {
    need(width);
    const uint8_t* bytes = bytes_at(pos_);
    uint64_t value = 0;
    for (size_t k = 0; k < width; ++k) value |= static_cast<uint64_t>(bytes[k]) << (8 * k);
    pos_ += width;
    return value;
  }

  size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  // Built in place: a Value copied through memory right after it was written as two fields
  // is read back as one 16-byte load the stores cannot forward to (a stall on every opcode).
  void push(Value value) { stack_.emplace_back(value.kind, value.num); }
  Value pop() {
    if (stack_.size() <= fence()) decline("stack underflow");
    Value value = stack_.back();
    stack_.pop_back();
    return value;
  }
  size_t pop_mark() {
    if (marks_.empty()) decline("no mark");
    const size_t mark = marks_.back();
    marks_.pop_back();
    if (mark > stack_.size()) decline("bad mark");
    return mark;
  }
  Value& top_above_fence(size_t depth) {  // stack_[size - 1 - depth], which must be above the fence
    if (stack_.size() < fence() + depth + 1) decline("stack underflow");
    return stack_.at(stack_.size() - 1 - depth);
  }

  Value new_container(Kind kind, std::vector<Value> items = {}) {
    if (!free_containers_.empty()) {  // a row's dict, reused (its items' storage with it)
      const size_t index = free_containers_.back();
      free_containers_.pop_back();
      Container& reused = arena_.containers.at(index);
      if (!items.empty()) reused.items = std::move(items);
      reused.kind = kind;
      reused.refs = 1;
      return Value{kind, static_cast<int64_t>(index)};
    }
    if (arena_.containers.size() >= std::numeric_limits<uint32_t>::max()) decline("too many containers");
    Container made;
    made.kind = kind;
    made.refs = 1;
    made.items = std::move(items);
    arena_.containers.push_back(std::move(made));
    return Value{kind, static_cast<int64_t>(arena_.containers.size() - 1)};
  }
  // A dict now read as a row of columns: nothing can reach it any more (its one reference was the
  // list's item; a memo GET finds its generation gone), so its container serves the next object.
  void recycle(size_t index) {
    Container& entry = arena_.containers.at(index);
    if (entry.generation == std::numeric_limits<uint32_t>::max()) return;  // a memo slot could not tell
    entry.items.clear();  // keeps its storage for the next dict's items
    entry.interned = Interned{};
    entry.columns = -1;
    entry.refs = 0;
    entry.row = false;
    entry.dropped = false;
    entry.first_of = -1;
    ++entry.generation;
    free_containers_.push_back(index);
  }
  static bool is_container(Kind kind) { return kind == Kind::List || kind == Kind::Dict || kind == Kind::Tuple; }
  Container& container_of(const Value& value, Kind kind) {
    if (value.kind != kind) decline("wrong container");
    return arena_.containers.at(static_cast<size_t>(value.num));
  }

  void note(Token token) {
    history_[history_at_ % history_.size()] = token;
    ++history_at_;
  }
  // The token `back` opcodes before the current one (1 = just before), Other before the stream.
  Token before(size_t back) const {
    if (back > history_at_ || back > history_.size()) return Token::Other;
    return history_[(history_at_ - back) % history_.size()];
  }
  // A tuple of `items` opcodes just before it: all scalars the vetting allows, and counted when wide.
  void check_tuple(size_t items) {
    bool wide = false;
    for (size_t back = 1; back <= items; ++back) {
      const Token token = before(back);
      if (token == Token::WideItem) {
        wide = true;
      } else if (token != Token::SmallItem) {
        decline("a tuple of other values");
      }
    }
    if (wide && ++wide_tuples_ > kMaxWideTuples) decline("too many wide tuples");
  }
  size_t tuple_items_before_mark() const {
    for (size_t back = 1; back <= static_cast<size_t>(kMaxTupleItems) + 1; ++back) {
      if (before(back) == Token::Mark) return back - 1;
    }
    decline("a tuple of other values");
  }

  void push_string(size_t length) {
    need(length);
    const uint8_t* text = bytes_at(pos_);
    if (!valid_utf8(text, length)) decline("not UTF-8");
    StrRef ref;
    ref.bytes = arena_.text_pool.add(text, length);
    ref.length = length;
    ref.field = field_named(text, length);
    arena_.strings.push_back(ref);
    pos_ += length;
    push(Value{Kind::Str, static_cast<int64_t>(arena_.strings.size() - 1)});
  }

  // LONG1: n bytes of little-endian two's complement. Token kind as the vetting's regex reads it.
  void push_long1(size_t at) {
    const size_t length = byte();
    need(length);
    const uint8_t* digits = bytes_at(pos_);
    bool uint64_max = length == 9 && digits[8] == 0x00;
    for (size_t k = 0; uint64_max && k < 8; ++k) uint64_max = digits[k] == 0xFF;
    Token token = Token::Other;
    if (length < 5) {
      token = Token::SmallItem;
    } else if (length <= 7 || (length == 8 && (digits[7] <= 0x1F || digits[7] >= 0xE0)) || uint64_max) {
      token = Token::WideItem;
    } else if (++large_ints_ > kMaxLargeInts) {
      decline("too many large integers");
    }
    Value value{Kind::Int, 0};
    if (length > 0) {
      uint64_t low = 0;
      for (size_t k = 0; k < length && k < 8; ++k) low |= static_cast<uint64_t>(digits[k]) << (8 * k);
      const bool negative = (digits[length - 1] & 0x80) != 0;
      if (length < 8) {
        if (negative) low |= ~uint64_t{0} << (8 * length);
        value.num = static_cast<int64_t>(low);
      } else {
        // Beyond 8 bytes, the rest must be the sign's extension: then the value fits 64 bits.
        for (size_t k = 8; k < length; ++k) {
          if (digits[k] != (negative ? 0xFF : 0x00)) decline("an integer beyond 64 bits");
        }
        const bool top_bit = (low >> 63) != 0;
        if (negative && !top_bit) decline("an integer beyond 64 bits");
        if (!negative && top_bit) {
          if (length == 8) decline("bad LONG1");  // impossible: 8 bytes with the top bit set are negative
          value.kind = Kind::UInt64;
        }
        value.num = static_cast<int64_t>(low);
      }
    }
    (void)at;
    pos_ += length;
    push(value);
    note(token);
  }

  void memo_put(uint64_t index) {
    if (stack_.size() <= fence()) decline("stack underflow");
    if (index >= memo_.size()) {
      if (index - memo_.size() > kMaxMemoGap) decline("a far memo index");
      memo_.resize(static_cast<size_t>(index) + 1);
    }
    MemoSlot& slot = memo_.at(index);
    if (!slot.present) ++memo_len_;
    const Value& top = stack_.back();
    int64_t num = top.num;
    if (is_container(top.kind)) {  // its index (under 2**32) and its generation
      num = static_cast<int64_t>(static_cast<uint64_t>(top.num) |
                                 (uint64_t{arena_.containers.at(static_cast<size_t>(top.num)).generation} << 32));
    }
    slot = MemoSlot{num, top.kind, true};
  }
  void memo_get(uint64_t index) {
    if (index >= memo_.size() || !memo_[index].present) decline("a memo index never put");
    Value value{memo_[index].kind, memo_[index].num};
    if (is_container(value.kind)) {
      const auto packed = static_cast<uint64_t>(value.num);
      value.num = static_cast<int64_t>(packed & 0xFFFFFFFFu);
      Container& target = arena_.containers.at(static_cast<size_t>(value.num));
      // A trace entry read as a row (its container since reused), or a list of them, met again:
      // the Python checker counts the sharing, and the dict or list would be needed whole.
      if (target.columns >= 0) decline("a list of trace entries met again");
      if (target.generation != static_cast<uint32_t>(packed >> 32) || target.row) {
        // A trace entry read as a row, met again: carried as a Repeat, so that one appended to a
        // device's trace again is refused as the Python path refuses it (without the million
        // dicts the Python path would build first); anywhere else the scan declines at conversion.
        const bool kept = target.generation == static_cast<uint32_t>(packed >> 32);
        push(Value{Kind::Repeat, kept ? target.first_of : -1});
        return;
      }
      if (target.refs < std::numeric_limits<uint8_t>::max()) ++target.refs;
    }
    push(value);
  }

  void set_items(Value& dict_value, size_t from) {
    if ((stack_.size() - from) % 2 != 0) decline("odd SETITEMS");
    Container& dict = container_of(dict_value, Kind::Dict);
    if (dict.row) decline("a trace entry changed after its row was read");
    for (size_t k = from; k < stack_.size(); k += 2) {
      const Kind key = stack_.at(k).kind;
      if (key == Kind::List || key == Kind::Dict) decline("an unhashable key");
    }
    dict.items.insert(dict.items.end(), stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end());
    stack_.resize(from);
  }
  // Items from `from` on were just appended to a list: plain trace entries become rows of the
  // list's columns (the first one starts them, if there is room), and their dicts' containers are
  // reused; the list keeps only its first entry, whole (the format guess reads it).
  void appended(const Value& list_value, size_t from) {
    Container& list = arena_.containers.at(static_cast<size_t>(list_value.num));
    if (from == 0 && !list.items.empty() && list.columns < 0 && arena_.columns.size() < kMaxColumnLists &&
        list.items[0].kind == Kind::Dict && next_tag_ < std::numeric_limits<int32_t>::max() - 4) {
      TraceColumns started;
      started.list = static_cast<size_t>(list_value.num);
      Interning interning(next_tag_);
      next_tag_ += 4;
      if (!add_row(arena_, list.items[0], started, interning)) return;
      Container& first = arena_.containers.at(static_cast<size_t>(list.items[0].num));
      first.row = true;
      first.first_of = static_cast<int32_t>(arena_.columns.size());
      if (arena_.columns.size() < kReservedColumnLists) reserve_rows(started, (size_ - pos_) / 48 + 1);
      list.columns = static_cast<int32_t>(arena_.columns.size());
      arena_.columns.push_back(std::move(started));
      interning_.push_back(std::move(interning));
      from = 1;
    }
    if (list.columns < 0) return;
    TraceColumns& columns = arena_.columns.at(static_cast<size_t>(list.columns));
    Interning& interning = interning_.at(static_cast<size_t>(list.columns));
    for (size_t k = from; k < list.items.size(); ++k) {
      const Value& item = list.items[k];
      if (item.kind == Kind::Repeat) {
        columns.repeats = true;
        if (item.num >= 0) columns.repeat_origins.push_back(static_cast<int32_t>(item.num));
        continue;
      }
      if (!add_row(arena_, item, columns, interning)) {
        // Not a list of plain entries after all: the rows before this one are needed as dicts.
        if (columns.rows > 1) decline("a list of trace entries not all plain");
        Container& first = arena_.containers.at(static_cast<size_t>(list.items[0].num));
        first.row = false;  // kept whole
        first.first_of = -1;
        list.columns = -1;
        columns = TraceColumns{};
        interning = Interning{};  // tagless: the ids objects remember for this list are never read again
        return;
      }
      recycle(static_cast<size_t>(item.num));
    }
    if (list.items.size() > 1) {  // the rows are columns now: the list holds a value per entry no more
      list.items.resize(1);
      list.dropped = true;
    }
  }

  // Room for the rows the rest of the input holds if it is all entries (PyTorch writes one in 60-70
  // bytes; 48 leaves room): the columns grow without copies, and pages never touched cost nothing.
  static void reserve_rows(TraceColumns& columns, size_t rows) {
    rows = std::min(rows, size_t{1} << 26);
    columns.addr.reserve(rows);
    columns.size.reserve(rows);
    columns.action_local.reserve(rows);
    columns.frames_local.reserve(rows);
    for (auto* column : {&columns.stream, &columns.time_us, &columns.device_free}) column->reserve_rows = rows;
    for (auto* column : {&columns.metadata_local, &columns.context_local}) column->reserve_rows = rows;
  }

  std::vector<Value> take_from(size_t from) {
    std::vector<Value> items(stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end());
    stack_.resize(from);
    return items;
  }

  // One opcode; true at STOP.
  bool step(uint8_t op, size_t at) {
    Token token = Token::Other;
    switch (op) {
      case 0x80: {  // PROTO
        if (byte() > 5) decline("unsupported protocol");
        break;
      }
      case 0x95: {  // FRAME: CPython reads the whole frame first, so it must be there
        const uint64_t length = little(8);
        if (length > size_ - pos_) decline("truncated frame");
        check_room(static_cast<size_t>(length));  // a frame inside a frame must end within it
        if (pos_ + length > frame_end_) frame_end_ = pos_ + static_cast<size_t>(length);
        // Not a token for the tuple rule: a pickler may start a frame between any two opcodes, a
        // tuple's items included (PyTorch's, at 64 KiB), and the tuple is the same without it.
        return false;
      }
      case '.':
        // The Python path hands the unpickler nothing after STOP, so a frame that runs on past it
        // cannot be read whole there: "truncated". Declined, so that is the answer here too.
        if (pos_ < frame_end_) decline("a STOP inside a frame");
        note(Token::Other);
        return true;
      case '}': push(new_container(Kind::Dict)); break;
      case ']': push(new_container(Kind::List)); break;
      case ')': push(new_container(Kind::Tuple)); break;
      case '(':
        marks_.push_back(stack_.size());
        token = Token::Mark;
        break;
      case 'N': push(Value{Kind::None, 0}); token = Token::SmallItem; break;
      case 0x88: push(Value{Kind::Bool, 1}); token = Token::SmallItem; break;
      case 0x89: push(Value{Kind::Bool, 0}); token = Token::SmallItem; break;
      case 'J': {
        const uint64_t bits = little(4);
        push(Value{Kind::Int, static_cast<int32_t>(static_cast<uint32_t>(bits))});
        token = Token::SmallItem;
        break;
      }
      case 'K': push(Value{Kind::Int, static_cast<int64_t>(little(1))}); token = Token::SmallItem; break;
      case 'M': push(Value{Kind::Int, static_cast<int64_t>(little(2))}); token = Token::SmallItem; break;
      case 0x8A: push_long1(at); return false;  // LONG1 notes its own token
      case 'G': {  // BINFLOAT: big-endian double
        need(8);
        const uint8_t* bytes = bytes_at(pos_);
        uint64_t bits = 0;
        for (size_t k = 0; k < 8; ++k) bits = (bits << 8) | bytes[k];
        pos_ += 8;
        arena_.floats.push_back(bits);
        push(Value{Kind::Float, static_cast<int64_t>(arena_.floats.size() - 1)});
        break;
      }
      case 0x8C: push_string(static_cast<size_t>(little(1))); break;  // SHORT_BINUNICODE
      case 'X': push_string(static_cast<size_t>(little(4))); break;  // BINUNICODE
      case 0x8D: {  // BINUNICODE8
        const uint64_t length = little(8);
        if (length > size_ - pos_) decline("truncated");
        push_string(static_cast<size_t>(length));
        break;
      }
      case 0x94: memo_put(memo_len_); break;  // MEMOIZE
      case 'q': memo_put(little(1)); break;  // BINPUT
      case 'r': {  // LONG_BINPUT: the vetting refuses an index past the bytes before it
        const uint64_t index = little(4);
        if (index > at) decline("a memo index past the bytes read");
        memo_put(index);
        break;
      }
      case 'h': memo_get(little(1)); break;
      case 'j': memo_get(little(4)); break;
      case '0': {  // POP: pops a mark if one is on top (CPython's rule)
        if (!marks_.empty() && marks_.back() == stack_.size()) {
          marks_.pop_back();
        } else {
          pop();
        }
        break;
      }
      case '1': {  // POP_MARK
        const size_t mark = pop_mark();
        stack_.resize(mark);
        break;
      }
      case 'a': {  // APPEND
        Value item = top_above_fence(0);
        const Value list_value = top_above_fence(1);
        Container& list = container_of(list_value, Kind::List);
        list.items.push_back(item);
        stack_.pop_back();
        appended(list_value, list.items.size() - 1);
        break;
      }
      case 'e': {  // APPENDS
        const size_t mark = pop_mark();
        if (mark < fence() + 1) decline("stack underflow");
        const Value list_value = stack_.at(mark - 1);
        Container& list = container_of(list_value, Kind::List);
        const size_t from = list.items.size();
        list.items.insert(list.items.end(), stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
        stack_.resize(mark);
        appended(list_value, from);
        break;
      }
      case 's': {  // SETITEM
        if (stack_.size() < fence() + 3) decline("stack underflow");
        set_items(stack_.at(stack_.size() - 3), stack_.size() - 2);
        break;
      }
      case 'u': {  // SETITEMS
        const size_t mark = pop_mark();
        if (mark < fence() + 1) decline("stack underflow");
        set_items(stack_.at(mark - 1), mark);
        break;
      }
      case 'l': {
        const Value list_value = new_container(Kind::List, take_from(pop_mark()));
        push(list_value);
        appended(list_value, 0);
        break;
      }
      case 'd': {
        const size_t mark = pop_mark();
        if ((stack_.size() - mark) % 2 != 0) decline("odd DICT");
        for (size_t k = mark; k < stack_.size(); k += 2) {
          const Kind key = stack_.at(k).kind;
          if (key == Kind::List || key == Kind::Dict) decline("an unhashable key");
        }
        push(new_container(Kind::Dict, take_from(mark)));
        break;
      }
      case 't': {
        const size_t items = tuple_items_before_mark();
        const size_t mark = pop_mark();
        if (stack_.size() - mark != items) decline("a tuple of other values");
        check_tuple(items);
        push(new_container(Kind::Tuple, take_from(mark)));
        break;
      }
      case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
        const size_t items = static_cast<size_t>(op - 0x84);
        check_tuple(items);
        if (stack_.size() < fence() + items) decline("stack underflow");
        push(new_container(Kind::Tuple, take_from(stack_.size() - items)));
        break;
      }
      default:
        decline("opcode " + std::to_string(op));
    }
    note(token);
    return false;
  }

  // The input's bytes [window_start_, window_end_) are at window_: all of them for an input in
  // memory, else buffer_'s, refilled by fill() from read_.
  const uint8_t* window_ = nullptr;
  size_t window_start_ = 0;
  size_t window_end_ = 0;
  size_t size_;
  ReadAt read_;
  size_t chunk_ = 0;
  std::vector<uint8_t> buffer_;
  size_t pos_ = 0;
  size_t frame_end_ = 0;  // where the last frame read ends (reads that start before it stay in it)
  Arena arena_;
  std::vector<Value> stack_;
  std::vector<size_t> marks_;
  // A memo entry: the value (a container's index with its generation), and whether it was put
  // (one 16-byte slot: one cache line to read).
  struct MemoSlot {
    int64_t num = 0;
    Kind kind = Kind::None;
    bool present = false;
  };
  std::vector<MemoSlot> memo_;
  std::vector<Interning> interning_;  // of arena_.columns, index for index
  int32_t next_tag_ = 0;  // the next interning table's number
  std::vector<size_t> free_containers_;  // rows' dicts, to reuse
  uint64_t memo_len_ = 0;
  std::array<Token, 16> history_{};
  size_t history_at_ = 0;
  int64_t large_ints_ = 0;
  int64_t wide_tuples_ = 0;
};

}  // namespace

namespace {

template <typename MakeMachine>
ScanResult run_machine(MakeMachine make) {
  ScanResult result;
  try {
    result.arena = make().run();
    result.ok = true;
  } catch (const Declined& declined) {
    result.reason = declined.reason;
  } catch (const std::bad_alloc&) {
    result.reason = "out of memory";
  } catch (const std::out_of_range&) {
    result.reason = "out of range";  // an at() that failed: a bug, but never a wrong answer
  } catch (const std::length_error&) {
    result.reason = "too large";
  }
  return result;
}

// Frames lists that hold the same objects in the same order intern to the same stack (PyTorch
// writes a new list for each entry, its frame dicts shared through the memo: a million entries,
// a few hundred stacks). The reader is handed one list of each content, in order of first
// appearance, the rows' ids remapped, so it checks and interns a few hundred lists instead of
// tens of thousands, and gives every row the stack it would have given it. Done on the final
// contents: a list can still grow after an entry takes it, and the reader sees it grown.
void merge_equal_frames(const Arena& arena, TraceColumns& columns) {
  std::vector<int32_t> merged(columns.frames.size());
  std::vector<Value> kept;
  std::unordered_map<std::string, int32_t> by_content;
  std::string key;
  for (size_t id = 0; id < columns.frames.size(); ++id) {
    const Value& frames = columns.frames[id];
    if (frames.kind != Kind::List) {  // None (interned once already)
      kept.push_back(frames);
      merged[id] = static_cast<int32_t>(kept.size() - 1);
      continue;
    }
    key.clear();
    for (const Value& item : arena.container(frames).items) {
      // The same kind and number is the same object: containers and strings are arena indices.
      const auto kind = static_cast<char>(item.kind);
      key.append(&kind, 1);
      key.append(reinterpret_cast<const char*>(&item.num), sizeof item.num);
    }
    const auto [found, added] = by_content.try_emplace(key, static_cast<int32_t>(kept.size()));
    if (added) kept.push_back(frames);
    merged[id] = found->second;
  }
  if (kept.size() == columns.frames.size()) return;
  for (int32_t& row : columns.frames_local) row = merged[static_cast<size_t>(row)];
  columns.frames = std::move(kept);
}

}  // namespace

ScanResult scan_pickle(const uint8_t* data, size_t size) {
  return run_machine([&] { return Machine(data, size); });
}

ScanResult scan_pickle(ReadAt read, size_t size, size_t chunk) {
  return run_machine([&] { return Machine(std::move(read), size, chunk); });
}

Extraction extract_traces(Arena& arena) {
  Extraction extraction;
  std::vector<uint8_t> taken(arena.columns.size(), 0);
  // Every list of rows whose columns are not taken here is read as Python objects from the arena:
  // where its entries' items were dropped, that cannot be, and the file is declined.
  bool has_segments = false;
  auto finish = [&]() -> Extraction {
    for (size_t k = 0; k < arena.columns.size(); ++k) {
      if (!taken[k] && arena.columns[k].rows > 1) {
        extraction.traces.clear();
        extraction.ok = false;
        extraction.reason = "trace entries outside a device's trace";
        return std::move(extraction);
      }
    }
    // Entries met again: every list of rows is a device's trace by now, so a row dropped since came
    // from one; a kept first entry, from the list it names. Met again only in device traces, the file
    // holds one entry at two places there, which the Python path refuses (before any other check of
    // a dict with 'segments'); met anywhere else, the Python path says what it makes of it.
    bool repeats = false, all_in_traces = true;
    for (const TraceColumns& trace : extraction.traces) {
      repeats |= trace.repeats;
      for (const int32_t origin : trace.repeat_origins) {
        if (origin < 0 || static_cast<size_t>(origin) >= taken.size() || !taken.at(static_cast<size_t>(origin))) {
          all_in_traces = false;
        }
      }
    }
    if (repeats && all_in_traces && has_segments) {
      extraction.refusal =
          "refused to load: device_traces refers to objects met elsewhere in the file: one trace entry at two "
          "places (met again through the pickle memo; a snapshot never shares its trace entries, PyTorch writes "
          "each event once)";
    } else if (repeats) {
      extraction.traces.clear();
      extraction.ok = false;
      extraction.reason = "a trace entry met again";
    }
    return std::move(extraction);
  };
  if (arena.root.kind != Kind::Dict) return finish();
  const Container& root = arena.container(arena.root);
  const Value* traces = nullptr;
  for (size_t k = 0; k + 1 < root.items.size(); k += 2) {
    const Value& key = root.items.at(k);
    if (key.kind == Kind::Str && arena.text(key) == "device_traces") traces = &root.items.at(k + 1);
    has_segments |= key.kind == Kind::Str && arena.text(key) == "segments";
  }
  if (traces == nullptr || traces->kind != Kind::List) return finish();
  // The columns replace the entries lists in the Python objects: only where nothing else (an
  // unknown key, the root holding itself) can reach them, else the copy of that other key differs.
  if (root.refs != 1 || arena.container(*traces).refs != 1) return finish();
  extraction.has_traces_list = true;
  extraction.traces_list = *traces;
  const Container& devices = arena.container(*traces);
  if (devices.items.size() > static_cast<size_t>(kMaxDevices)) return finish();  // the Python path refuses it
  for (size_t device = 0; device < devices.items.size(); ++device) {
    const Value& entries = devices.items.at(device);
    if (entries.kind != Kind::List) continue;
    const Container& list = arena.container(entries);
    if (list.refs != 1 || list.columns < 0) continue;
    const size_t index = static_cast<size_t>(list.columns);
    if (taken.at(index)) continue;  // the same list twice (refs would say so): the Python way
    taken.at(index) = 1;
    TraceColumns columns = std::move(arena.columns.at(index));
    arena.columns.at(index) = TraceColumns{};
    columns.device = device;
    if (!columns.has_user_metadata) {
      columns.metadata_local = LazyColumn<int32_t>{};
      columns.metadata = {};
    }
    if (!columns.has_compile_context) {
      columns.context_local = LazyColumn<int32_t>{};
      columns.context = {};
    }
    merge_equal_frames(arena, columns);
    extraction.traces.push_back(std::move(columns));
  }
  return finish();
}

}  // namespace memlens::scan
