// The service manager's readiness protocol (systemd's sd_notify, without libsystemd): a
// datagram of newline-separated assignments (READY=1, STOPPING=1, STATUS=...) to the UNIX
// socket $NOTIFY_SOCKET names, when it names one. A unit with Type=notify starts its
// dependants only once kvstashd says READY=1, after it registered with its cell and serves.
#pragma once

#include <string_view>

namespace kvstash::kvstashd {

// Sends `state` to the service manager. Without $NOTIFY_SOCKET (not under systemd, or a unit
// of another type), nothing; a socket that refuses it is reported once on stderr: the node
// serves either way, and the manager's start timeout says the rest.
void notify_service_manager(std::string_view state);

}  // namespace kvstash::kvstashd
