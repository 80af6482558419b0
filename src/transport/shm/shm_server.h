// The shm transport's server thread: accepts connections of our uid on the transport's
// listening socket and answers their requests (hello: the key table's descriptor; import:
// a region's descriptor). Nothing else runs on it; no copy ever does.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kvstash/transfer.h"

#include "common/fd.h"
#include "transport/shm/shm_registry.h"

namespace kvstash::transport::shm {

class Server {
 public:
  // Starts the thread on `listen` (bound to `socket_path` and listening, non-blocking).
  // `wake` is an eventfd that stop() writes to end the thread.
  Server(std::string socket_path, UniqueFd listen, UniqueFd wake, std::shared_ptr<Registry> registry);
  // stop().
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Ends the thread (blocks until it has), closing every connection, and removes the socket
  // file. Idempotent; not to be called from several threads at once.
  void stop();

  // What the server counted (refused, dropped connections), for Transport::counters().
  std::vector<TransportCounter> counters() const;

  // At most kMaxConnections connections that said hello; those that have not yet (a same-uid
  // client connects and says hello at once) have their own kMaxUnproven budget, the oldest
  // dropped for a newcomer, and kHelloTimeout to say it.
  static constexpr std::size_t kMaxConnections = 1024;
  static constexpr std::size_t kMaxUnproven = 64;
  static constexpr std::chrono::milliseconds kHelloTimeout{2000};
  // After a failed accept (out of descriptors: it would fail again at once) the listener rests.
  static constexpr std::chrono::milliseconds kAcceptPause{100};

 private:
  void serve();
  // Handles one request on an accepted connection; false: close it. Sets *said_hello when it
  // was a hello.
  bool handle(int sock, bool* said_hello);

  const std::string socket_path_;
  UniqueFd listen_;
  UniqueFd wake_;  // eventfd: written once by stop()
  std::shared_ptr<Registry> registry_;
  std::atomic<std::uint64_t> refused_{0}, accept_failures_{0}, hello_timeouts_{0}, unproven_evicted_{0};
  std::thread thread_;
};

}  // namespace kvstash::transport::shm
