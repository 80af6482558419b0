#include "kvstash/types.h"

#include <string>

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
  for (TransportKind k : kTransportKinds) {
    if (to_string(k) == name) return k;
  }
  return std::nullopt;
}

Result<std::vector<TransportKind>> parse_transport_list(std::string_view list) {
  std::vector<TransportKind> out;
  if (list == "all") return out;
  while (!list.empty()) {
    const std::size_t comma = list.find(',');
    const std::string_view name = list.substr(0, comma);
    list = comma == std::string_view::npos ? std::string_view{} : list.substr(comma + 1);
    if (name.empty()) continue;
    auto kind = parse_transport_kind(name);
    if (!kind) {
      std::string m = "unknown transport '";
      m.append(name).append("' (shm, tcp, ucx, verbs)");
      return Status::invalid_argument(std::move(m));
    }
    out.push_back(*kind);
  }
  return out;
}

}  // namespace kvstash
