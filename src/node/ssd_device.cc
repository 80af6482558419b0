#include "node/ssd_device.h"

#include <fcntl.h>
#include <liburing.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <list>
#include <mutex>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/system.h"

namespace kvstash::node {
namespace {

constexpr std::uint64_t kCancelTag = 1;  // a cancel's own completion: nothing to do
constexpr std::size_t kMaxIoBytes = std::size_t{1} << 30;

Status from_errno(int err, std::string_view what) {
  std::string m(what);
  m.append(": ").append(std::strerror(err));
  switch (err) {
    case EIO: return Status::io_error(std::move(m));
    case ENOSPC: return Status::no_space(std::move(m));
    case ECANCELED: return Status::timeout(m + " (cancelled at its deadline)");
    case EINVAL: return Status::invalid_argument(std::move(m));
    case EACCES:
    case EPERM: return Status::permission_denied(std::move(m));
    default: return Status::io_error(std::move(m));
  }
}

}  // namespace

struct SsdDevice::Impl {
  struct Batch;
  // One I/O of a batch: what is left of it.
  struct Op {
    Batch* batch = nullptr;
    SsdIo io;
    std::size_t done = 0;
    bool finished = false;
  };
  struct Batch {
    std::list<Op> ops;  // stable addresses: each Op is an SQE's user_data
    std::size_t left = 0;
    Status first;
    Deadline deadline;
    bool cancelled = false;
    Done done;
  };

  io_uring ring{};
  int fd = -1;
  std::uint32_t block_size = 4096;
  std::uint64_t capacity = 0;
  std::mutex mu;  // the submission queue, the batches, the counters
  std::list<Batch> inflight;
  std::function<int(const SsdIo&)> fault;
  Counters counters;
  std::atomic<bool> stop{false};
  std::thread reaper;
  bool queued = false;  // SQEs prepared since the last submit (mu held)

  ~Impl() {
    {
      // Every buffer in flight must be the caller's again before the ring goes.
      std::unique_lock lock(mu);
      for (auto& b : inflight) b.deadline = Deadline::min();
    }
    for (;;) {
      {
        std::lock_guard lock(mu);
        if (inflight.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    stop = true;
    if (reaper.joinable()) reaper.join();
    io_uring_queue_exit(&ring);
    if (fd >= 0) ::close(fd);
  }

  Status check(const SsdIo& io) const {
    if (io.length == 0 || io.length > kMaxIoBytes || io.buffer == nullptr) {
      return Status::invalid_argument("ssd: an I/O of " + std::to_string(io.length) +
                                      " bytes (1 byte to 1 GiB, with a buffer)");
    }
    const auto addr = reinterpret_cast<std::uintptr_t>(io.buffer);
    if (io.offset % block_size != 0 || io.length % block_size != 0 || addr % block_size != 0) {
      return Status::invalid_argument("ssd: offset, length and buffer must be multiples of the " +
                                      std::to_string(block_size) + "-byte block");
    }
    if (io.offset > capacity || io.length > capacity - io.offset) {
      return Status::invalid_argument("ssd: an I/O past the tier's " + std::to_string(capacity) + " bytes");
    }
    return {};
  }

  // Queues what is left of `op` (mu held); false when the ring has no room even after a submit.
  void prepare(Op& op) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (sqe == nullptr) {
      io_uring_submit(&ring);
      sqe = io_uring_get_sqe(&ring);
    }
    if (sqe == nullptr) {  // cannot happen without SQPOLL: a submit empties the queue
      finish(op, Status::no_space("ssd: the submission queue is full"));
      return;
    }
    std::byte* at = op.io.buffer + op.done;
    const auto n = static_cast<unsigned>(op.io.length - op.done);
    const auto offset = op.io.offset + op.done;
    if (op.io.write) {
      io_uring_prep_write(sqe, fd, at, n, offset);
    } else {
      io_uring_prep_read(sqe, fd, at, n, offset);
    }
    io_uring_sqe_set_data64(sqe, reinterpret_cast<std::uint64_t>(&op));
    queued = true;
  }

  void finish(Op& op, Status s) {
    if (op.finished) return;
    op.finished = true;
    Batch& b = *op.batch;
    if (!s.is_ok()) {
      ++counters.errors;
      if (s.code() == StatusCode::kTimeout) ++counters.timeouts;
      if (b.first.is_ok()) b.first = std::move(s);
    } else if (op.io.write) {
      ++counters.writes;
      counters.write_bytes += op.io.length;
    } else {
      ++counters.reads;
      counters.read_bytes += op.io.length;
    }
    --b.left;
  }

  // Hands out the batches that completed (mu held).
  std::vector<std::pair<Done, Status>> take_finished() {
    std::vector<std::pair<Done, Status>> out;
    for (auto it = inflight.begin(); it != inflight.end();) {
      if (it->left == 0) {
        out.emplace_back(std::move(it->done), std::move(it->first));
        it = inflight.erase(it);
      } else {
        ++it;
      }
    }
    return out;
  }

  void reap() {
    std::vector<std::pair<std::uint64_t, int>> seen;
    Deadline next_deadline_scan{};
    while (!stop) {
      __kernel_timespec wait{.tv_sec = 0, .tv_nsec = 20'000'000};
      io_uring_cqe* cqe = nullptr;
      if (io_uring_wait_cqe_timeout(&ring, &cqe, &wait) == 0 && cqe != nullptr) {
        unsigned head;
        io_uring_for_each_cqe(&ring, head, cqe) { seen.emplace_back(io_uring_cqe_get_data64(cqe), cqe->res); }
        io_uring_cq_advance(&ring, static_cast<unsigned>(seen.size()));
      }
      std::vector<std::pair<Done, Status>> finished;
      {
        std::lock_guard lock(mu);
        for (auto [data, res] : seen) {
          if (data == kCancelTag) continue;
          Op& op = *reinterpret_cast<Op*>(data);
          if (res < 0) {
            finish(op, from_errno(-res, op.io.write ? "ssd write" : "ssd read"));
          } else if (res == 0) {
            finish(op, Status::io_error("ssd: the device ended an I/O short, at offset " +
                                        std::to_string(op.io.offset + op.done)));
          } else if ((op.done += static_cast<std::size_t>(res)) < op.io.length) {
            prepare(op);  // a short read or write: the rest
          } else {
            finish(op, {});
          }
        }
        seen.clear();
        // Past their deadline: cancel what is still in flight (it completes with ECANCELED,
        // or, already on the device, when the device is done). Looked at every few
        // milliseconds, not on every completion.
        const auto now = Clock::now();
        for (auto& b : inflight) {
          if (now < next_deadline_scan) break;
          if (b.cancelled || b.deadline > now) continue;
          b.cancelled = true;
          for (auto& op : b.ops) {
            if (op.finished) continue;
            io_uring_sqe* sqe = io_uring_get_sqe(&ring);
            if (sqe == nullptr) break;
            io_uring_prep_cancel64(sqe, reinterpret_cast<std::uint64_t>(&op), 0);
            io_uring_sqe_set_data64(sqe, kCancelTag);
            queued = true;
          }
        }
        if (now >= next_deadline_scan) next_deadline_scan = now + std::chrono::milliseconds(5);
        if (queued) {
          io_uring_submit(&ring);
          queued = false;
        }
        finished = take_finished();
      }
      for (auto& [done, status] : finished) done(std::move(status));
    }
  }
};

namespace {
// The tier holds prompts' KV (and their keys, in its headers): a file must be its owner's
// alone, as the cluster-token file is; a block device, no one's but its owner's and group's.
// Checked on the descriptor opened.
Status check_private(int fd, const std::string& path, bool block_device) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return from_errno(errno, "ssd: stat " + path);
  const unsigned mode = st.st_mode & 07777;
  if (block_device) {
    if ((mode & 007) != 0) {
      char octal[8];
      std::snprintf(octal, sizeof octal, "%04o", mode);
      return Status::invalid_argument(
          "ssd: " + path + " may be read or written by others (mode " + octal +
          "): the tier holds prompts' KV; remove the others' access (chmod o-rw)");
    }
    return {};
  }
  KVSTASH_RETURN_IF_ERROR(
      sys::check_owner_only(mode, path, "the tier holds prompts' KV and keys").with_context("ssd"));
  if (st.st_uid != ::geteuid()) {
    return Status::invalid_argument("ssd: " + path + " belongs to uid " + std::to_string(st.st_uid) +
                                    ", not to this process's " + std::to_string(::geteuid()) +
                                    ": a tier file must be kvstashd's own");
  }
  return {};
}
}  // namespace

Result<std::unique_ptr<SsdDevice>> SsdDevice::open(const SsdOptions& o) {
  if (o.path.empty()) return Status::invalid_argument("ssd: the tier needs a path (--ssd)");
  std::unique_ptr<SsdDevice> d(new SsdDevice());
  d->impl_ = std::make_unique<Impl>();
  Impl& impl = *d->impl_;
  d->path_ = o.path;
  struct stat st {};
  const bool exists = ::stat(o.path.c_str(), &st) == 0;
  d->block_device_ = exists && S_ISBLK(st.st_mode);
  const int flags = O_RDWR | O_DIRECT | O_CLOEXEC | (d->block_device_ ? 0 : O_CREAT);
  impl.fd = ::open(o.path.c_str(), flags, 0600);
  if (impl.fd < 0) {
    const int err = errno;
    if (err == EINVAL) {
      return Status::unsupported("ssd: " + o.path +
                                 ": its file system takes no O_DIRECT (the tier needs it: a "
                                 "file on ext4 or xfs, or a block device)");
    }
    return from_errno(err, "ssd: open " + o.path);
  }
  KVSTASH_RETURN_IF_ERROR(check_private(impl.fd, o.path, d->block_device_));
  std::uint64_t size = o.capacity;
  if (d->block_device_) {
    std::uint64_t device_bytes = 0;
    int logical = 512;
    if (::ioctl(impl.fd, BLKGETSIZE64, &device_bytes) != 0) return from_errno(errno, "ssd: BLKGETSIZE64");
    if (::ioctl(impl.fd, BLKSSZGET, &logical) == 0 && logical > 4096) {
      impl.block_size = static_cast<std::uint32_t>(logical);
    }
    if (size == 0) size = device_bytes;
    if (size > device_bytes) {
      return Status::invalid_argument("ssd: --ssd-capacity " + std::to_string(size) + " is past " + o.path +
                                      "'s " + std::to_string(device_bytes) + " bytes");
    }
  } else {
    if (size == 0) return Status::invalid_argument("ssd: a file tier needs a capacity (--ssd-capacity)");
    if (::fallocate(impl.fd, 0, 0, static_cast<off_t>(size)) != 0) {
      const int err = errno;
      if (err == ENOSPC) {
        return Status::no_space("ssd: the file system of " + o.path + " cannot hold " + std::to_string(size) +
                                " bytes");
      }
      if (err != EOPNOTSUPP || ::ftruncate(impl.fd, static_cast<off_t>(size)) != 0) {
        return from_errno(err, "ssd: fallocate " + o.path);
      }
    }
  }
  d->block_size_ = impl.block_size;
  d->capacity_ = impl.capacity = size / impl.block_size * impl.block_size;
  if (d->capacity_ == 0) return Status::invalid_argument("ssd: a tier smaller than one block");
  const int rc = io_uring_queue_init(std::max<std::uint32_t>(o.queue_depth, 8), &impl.ring, 0);
  if (rc < 0) {
    if (rc == -ENOSYS || rc == -EPERM) {
      return Status::unsupported(
          "ssd: io_uring is off in this kernel (kernel.io_uring_disabled, or a seccomp "
          "profile): the tier needs it");
    }
    return from_errno(-rc, "ssd: io_uring_queue_init");
  }
  impl.reaper = std::thread([&impl] { impl.reap(); });
  return d;
}

SsdDevice::~SsdDevice() = default;

void SsdDevice::submit(std::vector<SsdIo> ios, Deadline deadline, Done done) {
  Impl& impl = *impl_;
  std::vector<std::pair<Done, Status>> finished;
  {
    std::lock_guard lock(impl.mu);
    Impl::Batch& b = impl.inflight.emplace_back();
    b.deadline = deadline;
    b.done = std::move(done);
    b.left = ios.size();
    for (const SsdIo& io : ios) {
      Impl::Op& op = b.ops.emplace_back();
      op.batch = &b;
      op.io = io;
      if (Status bad = impl.check(io); !bad.is_ok()) {
        impl.finish(op, std::move(bad));
      } else if (Clock::now() >= deadline) {
        impl.finish(op, Status::timeout("ssd: the deadline passed before the I/O"));
      } else if (const int err = impl.fault ? impl.fault(io) : 0; err != 0) {
        impl.finish(op, from_errno(err, io.write ? "ssd write (injected)" : "ssd read (injected)"));
      } else {
        impl.prepare(op);
      }
    }
    if (impl.queued) {
      io_uring_submit(&impl.ring);
      impl.queued = false;
    }
    finished = impl.take_finished();
  }
  for (auto& [fn, status] : finished) fn(std::move(status));
}

Status SsdDevice::run(std::vector<SsdIo> ios, Deadline deadline) {
  std::promise<Status> result;
  auto future = result.get_future();
  submit(std::move(ios), deadline, [&result](Status s) { result.set_value(std::move(s)); });
  return future.get();
}

Status SsdDevice::flush() {
  if (::fdatasync(impl_->fd) != 0) return from_errno(errno, "ssd: fdatasync " + path_);
  return {};
}

void SsdDevice::set_fault(std::function<int(const SsdIo&)> fault) {
  std::lock_guard lock(impl_->mu);
  impl_->fault = std::move(fault);
}

SsdDevice::Counters SsdDevice::counters() const {
  std::lock_guard lock(impl_->mu);
  return impl_->counters;
}

}  // namespace kvstash::node
