// kvstash/memory.h: buffers kvstash can move, and the descriptor of memory to register.
//
// A Buffer owns page-aligned host memory. By default it is backed by a memfd (or hugetlbfs
// pages when asked and available), so a same-host peer can map it through the shm transport
// by file descriptor; `shareable = false` gives plain anonymous memory. CUDA buffers arrive
// with the KV-cache layer.
//
// A MemoryRegion is a non-owning view of memory to register with the engine: a Buffer's, or
// memory the caller owns (an inference engine's KV tensors). Only fd-backed regions can be
// reached by a same-host peer through shm; every transport can use any region locally.
//
// Thread safety: a Buffer is move-only; its contents are the caller's to synchronize.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvstash/status.h"

namespace kvstash {

enum class MemoryKind : std::uint8_t { kHost = 0, kCuda = 1 };

struct BufferOptions {
  // Back the buffer by a memfd so same-host peers can map it (shm transport).
  bool shareable = true;
  // Try 2 MiB huge pages (MFD_HUGETLB); silently fall back to normal pages when the system
  // has none reserved. Buffer::huge_pages() says which one was used.
  bool huge_pages = false;
  // Allocate and map every page now (a shareable buffer's memory is committed at once:
  // allocation fails now rather than at a later write, and writers never fault). Huge-page
  // buffers are always populated.
  bool populate = false;
};

struct MemoryRegion {
  void* addr = nullptr;
  std::size_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  int fd = -1;                  // file backing [addr, addr+length), or -1
  std::uint64_t fd_offset = 0;  // offset of addr within fd

  // The sub-range [offset, offset+len); precondition: it lies within this region.
  MemoryRegion slice(std::size_t offset, std::size_t len) const {
    return {static_cast<std::byte*>(addr) + offset, len, kind, fd, fd < 0 ? 0 : fd_offset + offset};
  }
};

class Buffer {
 public:
  // Allocates `size` bytes (rounded up to the page size), zero-filled.
  // Errors: kInvalidArgument for size 0, kNoSpace when memory cannot be had, kIoError.
  static Result<Buffer> allocate(std::size_t size, const BufferOptions& options = {});

  Buffer() = default;
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }  // as requested, not rounded
  std::span<std::byte> bytes() const { return {data_, size_}; }
  int fd() const { return fd_; }  // -1 when not shareable
  bool huge_pages() const { return huge_pages_; }
  MemoryRegion region() const { return {data_, size_, MemoryKind::kHost, fd_, 0}; }

 private:
  void reset();

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t mapped_ = 0;
  int fd_ = -1;
  bool huge_pages_ = false;
};

}  // namespace kvstash
