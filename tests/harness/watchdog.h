// A point a test must reach by a deadline: if it has not (the watchdog was not destroyed by
// then), `expired` runs on the watchdog's own thread. It should say what hung and end the
// process, so that a hang fails loudly instead of stalling the suite.
//
// Thread safety: one owner; `expired` runs on another thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace kvstash::test {

class Watchdog {
 public:
  Watchdog(std::chrono::steady_clock::time_point fire_at, std::function<void()> expired)
      : thread_([this, fire_at, expired = std::move(expired)] {
          std::unique_lock lock(mu_);
          if (!cv_.wait_until(lock, fire_at, [&] { return done_; })) expired();
        }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace kvstash::test
