// The shm transport in the registry: its start and its look at this host.
#include <sys/statvfs.h>
#include <unistd.h>

#include "common/units.h"
#include "transport/registry.h"
#include "transport/shm/shm_transport.h"

namespace kvstash::transport::shm {
namespace {

Result<std::unique_ptr<Transport>> start(const EngineOptions& options) {
  return make_shm_transport(options.shm);
}

std::vector<TransportFinding> probe() {
  using Level = TransportFinding::Level;
  struct statvfs vfs {};
  if (::statvfs("/dev/shm", &vfs) == 0 && ::access("/dev/shm", W_OK) == 0) {
    return {{"transport shm", Level::kOk,
             "/dev/shm writable, " + units::format_size(std::uint64_t{vfs.f_bavail} * vfs.f_frsize) +
                 " free (same-host nodes are reached by memory copy)",
             ""}};
  }
  return {{"transport shm", Level::kWarn, "/dev/shm is missing or not writable: same-host nodes use tcp",
           "mount tmpfs on /dev/shm (containers: --shm-size or --ipc=host)"}};
}

}  // namespace

const Plugin& plugin() {
  static const Plugin p{TransportKind::kShm, &start, &probe};
  return p;
}

}  // namespace kvstash::transport::shm
