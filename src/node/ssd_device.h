// The NVMe tier's device (docs/nvme-tier.md: the design, and what is built): a file or a block
// device opened O_DIRECT, read and written in whole blocks through one io_uring, with a
// completion thread of its own. This layer moves bytes and reports what the device said; what
// lives where on it is the tier's business above.
//
// Buffers: an I/O's buffer, offset and length are multiples of block_size(). Until a batch's
// `done` runs, its buffers are the device's: the kernel may still be reading or writing them
// (an I/O past its deadline is cancelled, but one the device has started finishes first).
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash::node {

struct SsdOptions {
  // A regular file (created, 0600, and given its capacity with fallocate) or a block device.
  std::string path;
  // Bytes to use: required for a file; for a block device, at most its size (0: all of it).
  // Rounded down to whole blocks.
  std::uint64_t capacity = 0;
  // I/Os in flight at once (io_uring's submission queue).
  std::uint32_t queue_depth = 64;
};

struct SsdIo {
  bool write = false;
  std::uint64_t offset = 0;
  std::byte* buffer = nullptr;
  std::size_t length = 0;
};

class SsdDevice {
 public:
  // Opens (or creates) the device. Errors: kInvalidArgument (no path, a file without a
  // capacity, a capacity past the block device), kUnsupported (the file system takes no
  // O_DIRECT, as tmpfs; io_uring is off in this kernel), kNoSpace (the file system cannot hold
  // the capacity), kIoError, kPermissionDenied.
  static Result<std::unique_ptr<SsdDevice>> open(const SsdOptions& options);
  ~SsdDevice();
  SsdDevice(const SsdDevice&) = delete;
  SsdDevice& operator=(const SsdDevice&) = delete;

  std::uint64_t capacity() const { return capacity_; }
  std::uint32_t block_size() const { return block_size_; }
  const std::string& path() const { return path_; }
  // "file" or "block device".
  const char* kind() const { return block_device_ ? "block device" : "file"; }

  using Done = std::function<void(Status)>;
  // Submits `ios` as one batch; `done` runs once, on the completion thread, when every one of
  // them completed: OK, or the first failure (kIoError for the device's EIO, kNoSpace, kTimeout
  // for one cancelled at the deadline, kInvalidArgument for a misaligned or out-of-range I/O,
  // which is never submitted). A short read or write is carried on where it stopped.
  void submit(std::vector<SsdIo> ios, Deadline deadline, Done done);
  // submit() and wait for `done`: returns when the buffers are the caller's again.
  Status run(std::vector<SsdIo> ios, Deadline deadline);
  // fdatasync: what completed so far survives a power loss (a kill -9 needs no flush: a
  // completed O_DIRECT write is the device's).
  Status flush();

  // Fault injection for tests and the history checker's NVMe nemesis: called for every I/O
  // before it is submitted; a nonzero errno completes it with that error instead (EIO: the
  // device failed; ENOSPC: it is full), without touching the device.
  void set_fault(std::function<int(const SsdIo&)> fault);

  // Counters for /metrics.
  struct Counters {
    std::uint64_t reads = 0, writes = 0, read_bytes = 0, write_bytes = 0, errors = 0, timeouts = 0;
  };
  Counters counters() const;

  struct Impl;

 private:
  SsdDevice() = default;
  std::unique_ptr<Impl> impl_;
  std::string path_;
  std::uint64_t capacity_ = 0;
  std::uint32_t block_size_ = 4096;
  bool block_device_ = false;
};

}  // namespace kvstash::node
