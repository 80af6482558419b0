// Transport lists as command lines and config files spell them: "all", or "shm,tcp,verbs".
#pragma once

#include <string_view>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash {

// "all" or "": an empty list (every transport built in). kInvalidArgument naming an unknown
// name and the known ones.
Result<std::vector<TransportKind>> parse_transport_list(std::string_view list);

}  // namespace kvstash
