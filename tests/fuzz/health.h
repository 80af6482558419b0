// A real initiator's round trip, for the targets that serve a region to fuzz input: after an
// input, a fresh connection must still write a pattern into the region and read it back.
#pragma once

#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "transport/transport.h"

namespace kvstash::fuzz {

// Counts completions of posted ops, keeping the first error.
class WaitSink final : public transport::CompletionSink {
 public:
  void complete(std::uint32_t, Status status) override {
    std::lock_guard lock(mu_);
    if (first_error_.is_ok() && !status.is_ok()) first_error_ = std::move(status);
    ++done_;
    cv_.notify_all();
  }
  // The first error once `n` ops completed, or nullopt at the deadline.
  std::optional<Status> wait(std::size_t n, Deadline deadline) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return done_ >= n; })) return std::nullopt;
    return first_error_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::size_t done_ = 0;
  Status first_error_;
};

// Writes `pattern` to [base, base + pattern.size()) through `key` and reads it back. Returns
// what went wrong, or "" when the bytes came back.
inline std::string write_read(transport::Endpoint& ep, const transport::RemoteKey& key, std::uint64_t base,
                              const std::string& pattern, std::byte* scratch,
                              const transport::LocalRegistration* scratch_reg,
                              const transport::RemoteKey* read_key = nullptr) {
  const Deadline deadline = deadline_after(std::chrono::seconds(5));
  std::memcpy(scratch, pattern.data(), pattern.size());
  std::memset(scratch + pattern.size(), 0, pattern.size());
  transport::Op ops[2];
  WaitSink write_sink, read_sink;
  ops[0] = {.op = TransferOp::kWrite,
            .local = scratch,
            .local_reg = scratch_reg,
            .remote_addr = base,
            .remote_key = &key,
            .length = pattern.size(),
            .sink = &write_sink,
            .tag = 0};
  ep.post({&ops[0], 1});
  auto w = write_sink.wait(1, deadline);
  if (!w) return "write did not complete within 5 s";
  if (!w->is_ok()) return "write failed: " + w->to_string();
  ops[1] = {.op = TransferOp::kRead,
            .local = scratch + pattern.size(),
            .local_reg = scratch_reg,
            .remote_addr = base,
            .remote_key = read_key != nullptr ? read_key : &key,
            .length = pattern.size(),
            .sink = &read_sink,
            .tag = 1};
  ep.post({&ops[1], 1});
  auto r = read_sink.wait(1, deadline);
  if (!r) return "read did not complete within 5 s";
  if (!r->is_ok()) return "read failed: " + r->to_string();
  if (std::memcmp(scratch + pattern.size(), pattern.data(), pattern.size()) != 0)
    return "read other bytes back";
  return "";
}

}  // namespace kvstash::fuzz
