#include "kvstash/types.h"

namespace kvstash {

std::string_view to_string(TransferOp op) { return op == TransferOp::kRead ? "read" : "write"; }

std::string_view to_string(TransportKind kind) {
  switch (kind) {
    case TransportKind::kShm: return "shm";
    case TransportKind::kVerbs: return "verbs";
    case TransportKind::kUcx: return "ucx";
    case TransportKind::kTcp: return "tcp";
  }
  return "unknown";
}

std::optional<TransportKind> parse_transport_kind(std::string_view name) {
  for (auto k : {TransportKind::kShm, TransportKind::kVerbs, TransportKind::kUcx, TransportKind::kTcp}) {
    if (to_string(k) == name) return k;
  }
  return std::nullopt;
}

}  // namespace kvstash
