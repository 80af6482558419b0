#include "kvstash/status.h"

#include <cstring>

namespace kvstash {

std::string_view to_string(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kNotFound: return "not_found";
    case StatusCode::kStale: return "stale";
    case StatusCode::kTimeout: return "timeout";
    case StatusCode::kUnavailable: return "unavailable";
    case StatusCode::kNoSpace: return "no_space";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kCorrupt: return "corrupt";
    case StatusCode::kPermissionDenied: return "permission_denied";
    case StatusCode::kCancelled: return "cancelled";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kIoError: return "io_error";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

Status Status::from_errno(std::string_view what, int err) {
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  return {StatusCode::kIoError, std::move(m)};
}

std::string Status::to_string() const {
  std::string s(kvstash::to_string(code_));
  if (!message_.empty()) {
    s += ": ";
    s += message_;
  }
  return s;
}

Status Status::with_context(std::string_view context) const {
  if (is_ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return {code_, std::move(m)};
}

}  // namespace kvstash
