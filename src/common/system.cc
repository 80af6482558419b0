#include "common/system.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <system_error>

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

void* map_shared(int fd, std::size_t length, std::uint64_t offset, bool populate) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older headers lack it
#endif
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
  if (p == MAP_FAILED || !populate) return p;
  if (::madvise(p, length, MADV_POPULATE_WRITE) == 0) return p;
  // An older kernel (EINVAL): fault the pages in read-only; the writes upgrade them.
  ::munmap(p, length);
  return ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                static_cast<off_t>(offset));
}

namespace {

constexpr std::size_t kMaxSecret = 64 * 1024;  // a token or a password, not a data file

bool blank(std::string_view s) { return s.find_first_not_of(" \t\r\n\f\v") == std::string_view::npos; }

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// The file's contents without trailing newlines; with `private_only`, refused unless only its
// owner may read or write it, checked on the descriptor read.
Result<std::string> read_secret(const std::string& path, bool private_only) {
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return Status::invalid_argument("cannot read " + path + ": " + errno_text(errno));
  Closer closer{fd};
  if (private_only) {
    struct stat st {};
    if (::fstat(fd, &st) != 0)
      return Status::invalid_argument("cannot stat " + path + ": " + errno_text(errno));
    KVSTASH_RETURN_IF_ERROR(check_owner_only(st.st_mode, path, "a secret file must be private to its owner"));
  }
  std::string s;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::invalid_argument("cannot read " + path + ": " + errno_text(errno));
    if (n == 0) break;
    s.append(buf, static_cast<std::size_t>(n));
    if (s.size() > kMaxSecret) return Status::invalid_argument(path + " is larger than 64 KiB: not a secret");
  }
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  if (private_only && blank(s)) {
    return Status::invalid_argument(path +
                                    " is empty (or only whitespace): an empty secret would turn "
                                    "authentication off; write the secret into it");
  }
  return s;
}

}  // namespace

Status check_owner_only(unsigned mode, const std::string& path, std::string_view why) {
  if ((mode & 077) == 0) return {};
  char octal[8];
  std::snprintf(octal, sizeof octal, "%04o", mode & 07777);
  return Status::invalid_argument(path + " may be read or written by group or others (mode " + octal +
                                  "): " + std::string(why) + "; run chmod 600 " + path);
}

Result<std::string> read_secret_file(const std::string& path) { return read_secret(path, false); }

Result<std::string> read_private_secret_file(const std::string& path) { return read_secret(path, true); }

Status check_cluster_token(std::string_view token, std::string_view source) {
  if (!blank(token)) {
    if (token.size() >= kMinClusterTokenBytes) return {};
    return Status::invalid_argument(std::string(source) + " is " + std::to_string(token.size()) +
                                    " bytes: a cluster token must be at least " +
                                    std::to_string(kMinClusterTokenBytes) +
                                    " bytes, hard to guess (e.g. the output of `openssl rand -hex 32`)");
  }
  std::string m(source);
  m += token.empty() ? " is empty" : " is only whitespace";
  m += ": an empty cluster token would turn authentication off; give the cell's token, or none at all";
  return Status::invalid_argument(std::move(m));
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
