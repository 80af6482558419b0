// A CompletionSink for transport tests: records each tag's status, counts completions and
// tags completed more than once, and waits for a number of them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>

#include <gtest/gtest.h>

#include "transport/transport.h"

namespace kvstash::test {

class RecordingSink final : public transport::CompletionSink {
 public:
  ~RecordingSink() { EXPECT_EQ(duplicates_, 0) << "a tag completed more than once"; }

  void complete(std::uint32_t tag, Status status) override {
    std::lock_guard lock(mu_);
    if (statuses_.count(tag) != 0) ++duplicates_;
    statuses_[tag] = std::move(status);
    ++done_;
    cv_.notify_all();
  }

  // True once `n` completions arrived. The bound only keeps a broken build from hanging the
  // suite. `drive`, when given, is called between checks (a transport without a progress
  // thread advances only when someone calls into it).
  bool wait(std::size_t n, std::chrono::seconds limit = std::chrono::seconds(60),
            const std::function<void()>& drive = {}) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    std::unique_lock lock(mu_);
    while (done_ < n && std::chrono::steady_clock::now() < deadline) {
      if (drive) {
        lock.unlock();
        drive();
        lock.lock();
      } else {
        cv_.wait_until(lock, deadline);
      }
    }
    return done_ >= n;
  }
  // The tag's status; kInternal when it never completed.
  Status status(std::uint32_t tag) {
    std::lock_guard lock(mu_);
    auto it = statuses_.find(tag);
    return it == statuses_.end() ? Status::internal("no completion") : it->second;
  }
  std::map<std::uint32_t, Status> statuses() {
    std::lock_guard lock(mu_);
    return statuses_;
  }
  std::size_t count() {
    std::lock_guard lock(mu_);
    return done_;
  }
  int duplicates() {
    std::lock_guard lock(mu_);
    return duplicates_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::uint32_t, Status> statuses_;
  std::size_t done_ = 0;
  int duplicates_ = 0;
};

}  // namespace kvstash::test
