// Turn: one caller at a time does slow work on shared state (connecting, importing a key),
// without holding the state's mutex while it works, and a caller that finds the work under way
// waits for it only up to its own deadline. The state's mutex guards the turn too.
//
//   std::unique_lock lock(mu);
//   KVSTASH_ASSIGN_OR_RETURN(bool ready, turn.take(lock, deadline, [&] { return connected; }, "connect"));
//   if (ready) return ...;                    // someone else's turn did the work
//   lock.unlock(); ... slow work ...; lock.lock();
//   turn.end();                               // whatever happened, under the lock
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <string_view>

#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash {

class Turn {
 public:
  // With `lock` held: true once `ready()` holds (nothing left to do), false when this caller
  // took the turn (it works without the lock, then calls end() under it). kTimeout naming
  // `what` when another caller's turn is still under way at the deadline.
  template <typename Ready>
  Result<bool> take(std::unique_lock<std::mutex>& lock, Deadline deadline, Ready ready,
                    std::string_view what) {
    for (;;) {
      if (ready()) return true;
      if (!busy_) {
        busy_ = true;
        return false;
      }
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
        return Status::timeout(std::string(what) +
                               ": another caller's attempt did not finish before the deadline");
      }
    }
  }

  // Ends the turn taken by take() (with the lock held): waiting callers look again.
  void end() {
    busy_ = false;
    cv_.notify_all();
  }

 private:
  bool busy_ = false;
  std::condition_variable cv_;
};

}  // namespace kvstash
