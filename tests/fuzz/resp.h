// RESP2 framing for the catalog target's fake Redis: where one reply (or one command, an
// array of bulk strings) ends, by the grammar hiredis 0.14 reads.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvstash::fuzz {

// hiredis 0.14 allocates an array's element pointers when it reads the array's header, before
// any element has arrived: "*2000000000\r\n" is a 16 GB calloc inside hiredis (lazily
// touched outside a sanitizer). Inputs that announce more are left out of the run.
inline constexpr std::int64_t kMaxArray = 4096;
// Deeper nesting is a protocol error for hiredis 0.14.
inline constexpr int kMaxDepth = 7;

struct Framing {
  bool huge = false;  // an array over kMaxArray was announced
};

// Length of the one complete reply at the front of `in`; 0 when it is incomplete or malformed
// (hiredis then waits for more or fails, so whatever follows is never read as a reply).
inline std::size_t resp_length(std::string_view in, Framing& f, int depth = 0) {
  if (in.empty() || depth > kMaxDepth) return 0;
  const std::size_t eol = in.find("\r\n");
  if (eol == std::string_view::npos) return 0;
  const std::size_t head = eol + 2;
  auto number = [&](std::int64_t& v) {
    const char* b = in.data() + 1;
    const char* e = in.data() + eol;
    auto [p, ec] = std::from_chars(b, e, v);
    return b != e && ec == std::errc() && p == e;
  };
  switch (in[0]) {
    case '+':
    case '-':
    case ':': return head;
    case '$': {
      std::int64_t n;
      if (!number(n) || n < -1) return 0;
      if (n == -1) return head;
      const auto need = static_cast<std::uint64_t>(n) + 2;
      if (in.size() - head < need) return 0;  // hiredis skips the two bytes after it unread
      return head + static_cast<std::size_t>(need);
    }
    case '*': {
      std::int64_t n;
      if (!number(n) || n < -1) return 0;
      if (n > kMaxArray) {
        f.huge = true;
        return 0;
      }
      std::size_t at = head;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::size_t len = resp_length(in.substr(at), f, depth + 1);
        if (len == 0) return 0;
        at += len;
      }
      return at;
    }
    default: return 0;
  }
}

// Cuts `in` into complete replies; an incomplete or malformed rest is the last piece.
inline std::vector<std::string> split_replies(std::string_view in, Framing& f) {
  std::vector<std::string> out;
  while (!in.empty()) {
    const std::size_t len = resp_length(in, f);
    if (len == 0) {
      out.emplace_back(in);
      break;
    }
    out.emplace_back(in.substr(0, len));
    in.remove_prefix(len);
  }
  return out;
}

}  // namespace kvstash::fuzz
