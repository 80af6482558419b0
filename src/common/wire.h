// Little-endian encoding of the small binary records kvstash exchanges (addresses, keys,
// protocol headers), and their text form for pipes and config files (hex).
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace kvstash::wire {

class Writer {
 public:
  void u8(std::uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u16(std::uint16_t v) { put(v); }
  void u32(std::uint32_t v) { put(v); }
  void u64(std::uint64_t v) { put(v); }
  void raw(std::string_view s) { out_.append(s); }
  // A u32 length followed by the bytes.
  void bytes(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    raw(s);
  }
  std::string take() { return std::move(out_); }

 private:
  template <class T>
  void put(T v) {
    char b[sizeof(T)];
    for (std::size_t i = 0; i < sizeof(T); ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
    out_.append(b, sizeof(T));
  }
  std::string out_;
};

// Reads what Writer wrote. Every read fails softly: once a read runs past the end, ok() is
// false and all further reads return zero/empty, so a parser checks once at the end.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  std::uint8_t u8() { return get<std::uint8_t>(); }
  std::uint16_t u16() { return get<std::uint16_t>(); }
  std::uint32_t u32() { return get<std::uint32_t>(); }
  std::uint64_t u64() { return get<std::uint64_t>(); }
  std::string_view raw(std::size_t n) {
    if (!ok_ || in_.size() - pos_ < n) return fail();
    auto s = in_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::string_view bytes() { return raw(u32()); }
  bool ok() const { return ok_; }
  bool at_end() const { return ok_ && pos_ == in_.size(); }

 private:
  std::string_view fail() {
    ok_ = false;
    return {};
  }
  template <class T>
  T get() {
    auto s = raw(sizeof(T));
    if (!ok_) return 0;
    T v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      v |= static_cast<T>(static_cast<T>(static_cast<unsigned char>(s[i])) << (8 * i));
    }
    return v;
  }
  std::string_view in_;
  std::size_t pos_ = 0;
  bool ok_ = true;
};

std::string to_hex(std::string_view bytes);
// `v` as 16 lower-case hex digits, most significant first (checksums in records and output).
std::string to_hex64(std::uint64_t v);
// nullopt unless `text` is an even number of hex digits.
std::optional<std::string> from_hex(std::string_view text);

}  // namespace kvstash::wire
