#include "common/system.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>

namespace kvstash::sys {

void random_bytes(void* out, std::size_t n) {
  auto* p = static_cast<unsigned char*>(out);
  while (n > 0) {
    ssize_t got = getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      std::abort();  // the kernel CSPRNG is not optional: keys must never be guessable
    }
    p += got;
    n -= static_cast<std::size_t>(got);
  }
}

Result<std::string> read_secret_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::invalid_argument("cannot read " + path);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

std::uint64_t random_u64() {
  std::uint64_t v = 0;
  random_bytes(&v, sizeof v);
  return v;
}

const std::string& boot_id() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string s;
    std::getline(in, s);
    return s;
  }();
  return id;
}

}  // namespace kvstash::sys
