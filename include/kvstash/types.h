// kvstash/types.h: small vocabulary types shared by every kvstash header.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "kvstash/status.h"

namespace kvstash {

using Clock = std::chrono::steady_clock;
// Every blocking or asynchronous kvstash operation takes an absolute deadline.
using Deadline = Clock::time_point;

inline Deadline deadline_after(std::chrono::nanoseconds d) { return Clock::now() + d; }

enum class TransferOp : std::uint8_t { kRead = 0, kWrite = 1 };

// Listed in the engine's order of preference for a peer that both sides can reach by several.
enum class TransportKind : std::uint8_t { kShm = 0, kVerbs = 1, kUcx = 2, kTcp = 3 };
// Every kind this version knows, built into this binary or not (Engine::transports() says
// which are running).
inline constexpr TransportKind kTransportKinds[] = {TransportKind::kShm, TransportKind::kVerbs,
                                                    TransportKind::kUcx, TransportKind::kTcp};

std::string_view to_string(TransferOp op);
std::string_view to_string(TransportKind kind);  // "shm", "verbs", "ucx", "tcp"
std::optional<TransportKind> parse_transport_kind(std::string_view name);
// A transport list as command lines, config files and the C and Python StoreOptions spell it:
// "shm,tcp,verbs", or "all" / "" for an empty list (every transport built in).
// kInvalidArgument naming an unknown name and the known ones.
Result<std::vector<TransportKind>> parse_transport_list(std::string_view list);

}  // namespace kvstash
