// Session, errors, tables and formatting for the kvstash CLI.
#include "cli.h"

#include <cctype>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>

#include "common/system.h"
#include "common/units.h"
#include "kvstash/store.h"
#include "metadata/cell.h"
#include "metadata/cell_directory.h"
#include "metadata/redis_client.h"

namespace kvstash::cli {

Session::Session(const Globals& g) : g_(g) {}
Session::~Session() = default;

std::chrono::milliseconds Session::timeout() const {
  auto t = units::parse_duration(g_.timeout);
  return t.is_ok() && t->count() > 0 ? *t : std::chrono::milliseconds(10000);
}

Status Session::credentials() {
  if (have_credentials_) return {};
  if (!g_.password_file.empty()) {
    KVSTASH_ASSIGN_OR_RETURN(password_, sys::read_secret_file(g_.password_file));
  } else if (const char* env = std::getenv("KVSTASH_REDIS_PASSWORD"); env != nullptr) {
    password_ = env;
  }
  if (g_.token_file_given) {
    if (g_.token_file.empty()) return Status::invalid_argument("--cluster-token-file names no file");
    KVSTASH_ASSIGN_OR_RETURN(token_, sys::read_private_secret_file(g_.token_file));
    KVSTASH_RETURN_IF_ERROR(sys::check_cluster_token(token_, "the token in " + g_.token_file));
  } else if (const char* env = std::getenv("KVSTASH_CLUSTER_TOKEN"); env != nullptr) {
    KVSTASH_RETURN_IF_ERROR(sys::check_cluster_token(env, "KVSTASH_CLUSTER_TOKEN"));
    token_ = env;
  }
  have_credentials_ = true;
  return {};
}

Result<metadata::Cell*> Session::cell() {
  if (cell_) return cell_.get();
  if (all_cells()) {
    return Status::invalid_argument("--cell all: this command works on one cell (name it with --cell NAME)");
  }
  KVSTASH_RETURN_IF_ERROR(credentials());
  metadata::CellOptions o;
  o.redis.url = g_.redis_url;
  o.redis.password = password_;
  o.redis.connect_timeout = std::min(timeout(), std::chrono::milliseconds(5000));
  o.redis.command_timeout = timeout();
  o.redis.reconnect_budget = std::min(timeout(), std::chrono::milliseconds(3000));
  o.cell = g_.cell;
  KVSTASH_ASSIGN_OR_RETURN(cell_, metadata::Cell::open(o));
  return cell_.get();
}

Result<Store*> Session::store() {
  if (store_) return store_.get();
  KVSTASH_RETURN_IF_ERROR(credentials());
  StoreOptions o;
  o.redis_url = g_.redis_url;
  o.redis_password = password_;
  o.engine.cluster_token = token_;
  o.cell = g_.cell;
  o.cell_directory = all_cells();
  o.timeout = timeout();
  o.redis_connections = 1;
  o.async_threads = 1;
  KVSTASH_ASSIGN_OR_RETURN(store_, Store::open(o));
  return store_.get();
}

Result<metadata::RedisClient*> Session::directory() {
  if (directory_) return directory_.get();
  KVSTASH_RETURN_IF_ERROR(credentials());
  metadata::RedisOptions o;
  o.url = g_.redis_url;
  o.password = password_;
  o.connect_timeout = std::min(timeout(), std::chrono::milliseconds(5000));
  o.command_timeout = timeout();
  o.reconnect_budget = std::min(timeout(), std::chrono::milliseconds(3000));
  o.cluster_key = metadata::kCellDirectoryKey;
  KVSTASH_ASSIGN_OR_RETURN(directory_, metadata::RedisClient::connect(o));
  return directory_.get();
}

std::string Session::redis_display() const {
  auto u = metadata::RedisUrl::parse(g_.redis_url);
  return u.is_ok() ? u->redacted() : g_.redis_url;
}

std::string redis_version(metadata::RedisClient& r) {
  auto info = r.command({"INFO", "server"});
  if (!info.is_ok()) return "?";
  const std::string_view text = info->str();
  const std::string_view tag = "redis_version:";
  const auto at = text.find(tag);
  if (at == std::string_view::npos) return "?";
  const auto end = text.find_first_of("\r\n", at);
  return std::string(text.substr(at + tag.size(), end - at - tag.size()));
}

namespace {

// A memory node refused the data path: the cluster tokens differ (every transport says so).
bool cluster_token_refused(const Status& s) {
  return s.code() == StatusCode::kPermissionDenied && s.message().find("cluster token") != std::string::npos;
}

// Whether the error came from the cell's Redis rather than from a memory node: the two need
// different fixes.
bool about_redis(const Status& s) {
  std::string m = s.message();
  for (char& c : m) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return m.find("redis") != std::string::npos || m.find("sentinel") != std::string::npos;
}

std::string_view fix_for(const Status& s) {
  if (cluster_token_refused(s)) {
    return "the memory nodes and this client must hold the same cluster token: --cluster-token-file FILE or "
           "KVSTASH_CLUSTER_TOKEN";
  }
  switch (s.code()) {
    case StatusCode::kUnavailable:
      if (!about_redis(s)) {
        return "a memory node did not take the connection: check that its kvstashd runs and is reachable from "
               "here (`kvstash nodes` lists them), and its /metrics for refused connections (a connection "
               "limit, or a cluster-token backoff after failed handshakes)";
      }
      return "is redis-server running there? Point --redis (or KVSTASH_REDIS_URL) at the cell's Redis";
    case StatusCode::kPermissionDenied:
      return "check the ACL user and password: redis://user:password@host:port/db, KVSTASH_REDIS_PASSWORD, "
             "or --redis-password-file";
    case StatusCode::kTimeout:
      return "Redis or a memory node did not answer in time; raise --timeout or check them";
    case StatusCode::kCorrupt:
      return "a record does not parse or the cell's schema is another version: check that every kvstash "
             "binary of the cell is the same release";
    case StatusCode::kNoSpace: return "the cell is full: add memory nodes, or free room with `kvstash evict`";
    case StatusCode::kNotFound: return "`kvstash ls` lists objects, `kvstash nodes` lists nodes";
    default: return {};
  }
}

}  // namespace

int fail(const Status& s, std::string_view doing, const Session* session, std::string_view fix_text) {
  std::cerr << "kvstash: " << doing << ": " << s.message() << " (" << to_string(s.code()) << ")\n";
  if (auto fix = fix_text.empty() ? fix_for(s) : fix_text; !fix.empty()) {
    std::cerr << "  fix: " << fix;
    if (session != nullptr && !cluster_token_refused(s) && about_redis(s) &&
        (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kPermissionDenied)) {
      std::cerr << " (now " << session->redis_display() << ")";
    }
    std::cerr << "\n";
  }
  switch (s.code()) {
    case StatusCode::kNotFound: return kExitNotFound;
    case StatusCode::kInvalidArgument: return kExitUsage;
    default: return kExitError;
  }
}

Table::Table(std::vector<std::string> header) : header_(std::move(header)) {}

void Table::row(std::vector<std::string> cells) {
  cells.resize(header_.size());
  rows_.push_back(std::move(cells));
}

namespace {

bool numeric(const std::string& s) {
  if (s.empty() || s == "-") return false;
  return (s[0] >= '0' && s[0] <= '9') && s.find_first_not_of("0123456789.,% KMGTiBx") == std::string::npos;
}

}  // namespace

std::string Table::str() const {
  std::vector<std::size_t> width(header_.size());
  std::vector<bool> right(header_.size(), true);
  for (std::size_t c = 0; c < header_.size(); ++c) width[c] = header_[c].size();
  for (const auto& r : rows_) {
    for (std::size_t c = 0; c < r.size(); ++c) {
      width[c] = std::max(width[c], r[c].size());
      if (!r[c].empty() && r[c] != "-" && !numeric(r[c])) right[c] = false;
    }
  }
  // Numeric columns (and their headers) right-aligned, the rest left; no trailing blanks.
  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string l;
    for (std::size_t c = 0; c < cells.size(); ++c) {
      const std::size_t pad = width[c] - cells[c].size();
      if (right[c]) l.append(pad, ' ');
      l += cells[c];
      if (c + 1 < cells.size()) l.append(right[c] ? 2 : pad + 2, ' ');
    }
    while (!l.empty() && l.back() == ' ') l.pop_back();
    out += l;
    out += '\n';
  };
  line(header_);
  for (const auto& r : rows_) line(r);
  return out;
}

std::string format_duration(std::chrono::milliseconds d) {
  const std::int64_t ms = d.count();
  if (ms < 0) return "-";
  if (ms < 10000) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1fs", static_cast<double>(ms) / 1000);
    return b;
  }
  std::int64_t s = ms / 1000;
  const std::int64_t days = s / 86400, hours = s % 86400 / 3600, mins = s % 3600 / 60, secs = s % 60;
  auto two = [](std::int64_t a, const char* ua, std::int64_t b, const char* ub) {
    std::string r = std::to_string(a) + ua;
    if (b > 0) r.append(" ").append(std::to_string(b)).append(ub);
    return r;
  };
  if (days > 0) return two(days, "d", hours, "h");
  if (hours > 0) return two(hours, "h", mins, "m");
  if (mins > 0) return two(mins, "m", secs, "s");
  return std::to_string(secs) + "s";
}

std::string format_time(std::int64_t ms_since_epoch) {
  if (ms_since_epoch <= 0) return "-";
  const std::time_t t = static_cast<std::time_t>(ms_since_epoch / 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char b[40];
  std::strftime(b, sizeof b, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return b;
}

std::string format_gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GB", bytes / 1e9);
  return b;
}

Progress::Progress(std::string label, std::uint64_t total)
    : label_(std::move(label)), total_(total), tty_(isatty(STDERR_FILENO) == 1) {}

Progress::~Progress() {
  if (tty_) std::cerr << "\n";
}

void Progress::update(std::uint64_t done, std::string_view note) {
  if (!tty_) return;
  constexpr int kWidth = 30;
  const double f = total_ == 0 ? 1.0 : std::min(1.0, static_cast<double>(done) / static_cast<double>(total_));
  const int filled = static_cast<int>(f * kWidth);
  std::cerr << "\r" << label_ << " [" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] "
            << done << "/" << total_ << " " << note << "\033[K" << std::flush;
}

}  // namespace kvstash::cli
