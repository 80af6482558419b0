#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "kvstash/memory.h"

#include "common/system.h"

namespace kvstash {
namespace {

constexpr std::size_t kHugePage = 2u << 20;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

}  // namespace

Result<Buffer> Buffer::allocate(std::size_t size, const BufferOptions& options) {
  if (size == 0) return Status::invalid_argument("buffer size must be > 0");
  Buffer b;
  b.size_ = size;
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  if (!options.shareable) {
    b.mapped_ = round_up(size, page);
    void* p = mmap(nullptr, b.mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return Status::no_space("mmap of " + std::to_string(size) + " bytes failed");
    b.data_ = static_cast<std::byte*>(p);
    return b;
  }
  if (options.huge_pages) {
    int fd = memfd_create("kvstash-buffer", MFD_CLOEXEC | MFD_HUGETLB);
    if (fd >= 0) {
      std::size_t len = round_up(size, kHugePage);
      void* p = MAP_FAILED;
      if (ftruncate(fd, static_cast<off_t>(len)) == 0) {
        p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
      }
      if (p != MAP_FAILED) {
        b.fd_ = fd;
        b.mapped_ = len;
        b.data_ = static_cast<std::byte*>(p);
        b.huge_pages_ = true;
        return b;
      }
      close(fd);  // no huge pages reserved: fall back to normal pages
    }
  }
  int fd = memfd_create("kvstash-buffer", MFD_CLOEXEC);
  if (fd < 0) return Status::from_errno("memfd_create", errno);
  b.fd_ = fd;
  b.mapped_ = round_up(size, page);
  if (ftruncate(fd, static_cast<off_t>(b.mapped_)) != 0) {
    return Status::no_space("cannot size a memfd to " + std::to_string(size) + " bytes");
  }
  // Committed up front: the memory exists now (or allocate fails here, not at the first
  // write), and the writers never stall on allocating and zeroing pages.
  if (options.populate && fallocate(fd, 0, 0, static_cast<off_t>(b.mapped_)) != 0) {
    return Status::no_space("cannot commit " + std::to_string(size) + " bytes of memory");
  }
  void* p = sys::map_shared(fd, b.mapped_, 0, options.populate);
  if (p == MAP_FAILED) return Status::no_space("mmap of " + std::to_string(size) + " bytes failed");
  b.data_ = static_cast<std::byte*>(p);
  return b;
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      fd_(std::exchange(other.fd_, -1)),
      huge_pages_(std::exchange(other.huge_pages_, false)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    fd_ = std::exchange(other.fd_, -1);
    huge_pages_ = std::exchange(other.huge_pages_, false);
  }
  return *this;
}

Buffer::~Buffer() { reset(); }

void Buffer::reset() {
  if (data_ != nullptr) munmap(data_, mapped_);
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  fd_ = -1;
  size_ = mapped_ = 0;
}

}  // namespace kvstash
