// kvstash/status.h: the error type of every kvstash API.
//
// A Status is either OK or a (code, message) pair. Codes form a closed set so callers can
// branch on them (retry on kUnavailable, recompute on kNotFound/kStale, ...); the message is
// for humans and logs. Result<T> carries either a T or a non-OK Status. No exception crosses
// the public API.
//
// Thread safety: both are plain values; distinct objects may be used from distinct threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvstash {

enum class StatusCode : std::uint8_t {
  kOk = 0,
  kNotFound,          // no such key, object, peer or registration
  kStale,             // the object changed or was fenced while it was being read
  kTimeout,           // the deadline passed before the operation completed
  kUnavailable,       // a peer, node or service is unreachable or died; retry may succeed
  kNoSpace,           // out of memory, pages or queue slots
  kInvalidArgument,   // the caller passed something malformed or out of range
  kCorrupt,           // data or a record failed validation (checksum, format, version)
  kPermissionDenied,  // wrong key, token or credentials; access outside a granted region
  kCancelled,         // the caller cancelled the operation
  kUnsupported,       // the feature is not built in or not offered by this hardware
  kIoError,           // an operating-system call failed
  kInternal,          // a bug in kvstash; please report it
};

// "ok", "not_found", ...: stable names, also used as metric labels and CLI output.
std::string_view to_string(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }
  static Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status stale(std::string m) { return {StatusCode::kStale, std::move(m)}; }
  static Status timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
  static Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status no_space(std::string m) { return {StatusCode::kNoSpace, std::move(m)}; }
  static Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status corrupt(std::string m) { return {StatusCode::kCorrupt, std::move(m)}; }
  static Status permission_denied(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }
  static Status cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
  static Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status io_error(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
  static Status internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  // An kIoError whose message ends with strerror(err).
  static Status from_errno(std::string_view what, int err);

  bool is_ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "not_found: no object 'abc'", or "ok".
  std::string to_string() const;

  // Same code, message prefixed with context: "connect 10.0.0.1:7000: <message>".
  Status with_context(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  // The error; OK when the result holds a value.
  Status status() const { return is_ok() ? Status() : std::get<Status>(v_); }

  // Precondition: is_ok().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace kvstash

// Returns the status from the enclosing function when `expr` (a Status) is not OK.
#define KVSTASH_RETURN_IF_ERROR(expr)           \
  do {                                          \
    ::kvstash::Status kvstash_s_ = (expr);      \
    if (!kvstash_s_.is_ok()) return kvstash_s_; \
  } while (0)

#define KVSTASH_CONCAT_INNER_(a, b) a##b
#define KVSTASH_CONCAT_(a, b) KVSTASH_CONCAT_INNER_(a, b)
// `KVSTASH_ASSIGN_OR_RETURN(auto x, make_x());` declares x from a Result or returns its error.
#define KVSTASH_ASSIGN_OR_RETURN(decl, expr) \
  KVSTASH_ASSIGN_OR_RETURN_(KVSTASH_CONCAT_(kvstash_r_, __LINE__), decl, expr)
#define KVSTASH_ASSIGN_OR_RETURN_(tmp, decl, expr) \
  auto tmp = (expr);                               \
  if (!tmp.is_ok()) return tmp.status();           \
  decl = std::move(tmp).value()
