// The shm transport's server thread: accepts connections of our uid on the transport's
// listening socket and answers their requests (hello: the key table's descriptor; import:
// a region's descriptor). Nothing else runs on it; no copy ever does.
#pragma once

#include <memory>
#include <string>
#include <thread>

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

 private:
  void serve();
  // Handles one request on an accepted connection; false: close it.
  bool handle(int sock);

  const std::string socket_path_;
  UniqueFd listen_;
  UniqueFd wake_;  // eventfd: written once by stop()
  std::shared_ptr<Registry> registry_;
  std::thread thread_;
};

}  // namespace kvstash::transport::shm
