// kvstash-history's checker: the clients' logs against the promise (a get returns exactly the
// bytes of one put of its key that was not definitely replaced before it began), and the run cut
// into disturbed and quiet phases for put success.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace kvstash::history {

struct Put {
  std::string key;
  std::size_t size = 0;
  std::int64_t t_inv = 0, t_ret = 0;
  int code = 0;
  bool dropped = false;  // a stream never committed
};
struct Change {  // a put or remove of a key that returned OK
  std::int64_t t_inv = 0, t_ret = 0;
};
struct Get {
  std::string key;
  std::int64_t t_inv = 0, t_ret = 0;
  std::size_t size = 0;
  long long put_id = -1;
  std::string problem;
  std::string client;
};

struct Report {
  std::map<std::string, std::uint64_t> ops;     // by kind and outcome
  std::uint64_t gets_checked = 0;               // gets that returned bytes
  std::uint64_t gets_recovered = 0;             // of those, older bytes a Redis loss brought back
  std::vector<std::string> overdue;             // returned more than 1 s after their deadline
  std::vector<std::string> wrong;               // wrong bytes, described
  std::map<std::string, std::uint64_t> faults;  // the nemesis's actions
  std::vector<std::string> failures;            // clients that crashed or hung, setup errors
  std::vector<std::string> pages;               // page accounting problems at the end
  struct PutCall {
    std::int64_t t_inv = 0, t_ret = 0;
    bool ok = false;
    int code = 0;     // its StatusCode
    std::string why;  // a failure's message
  };
  std::vector<PutCall> put_calls;  // every put (not the dropped streams), for the phases
};

// A stretch of the run: disturbed (a fault, and the settling after it) or quiet.
struct Phase {
  std::int64_t from_ns = 0, to_ns = 0;
  std::vector<std::string> faults;  // empty: quiet
  std::uint64_t puts = 0, puts_ok = 0;
  std::map<int, std::uint64_t> failed;   // StatusCode -> puts that ended with it
  std::map<int, std::string> first_why;  // StatusCode -> the message of the first of them
  double success() const {
    return puts == 0 ? 1.0 : static_cast<double>(puts_ok) / static_cast<double>(puts);
  }
};

// After a fault ends, the cell settles: a dead node's heartbeat TTL runs out (2 s), clients
// stop avoiding a node they failed to reach (5 s). Puts before then count to the fault's phase.
// A Redis fault lasts until every node registered again with the master that serves now and
// it takes writes (the nemesis waits for that), and settles longer: clients find the new
// master, reservations and leases of the old one run out.
constexpr std::int64_t kSettleNs = 6'000'000'000;
constexpr std::int64_t kRedisSettleNs = 10'000'000'000;
// A quiet stretch shorter than this between two disturbed ones is part of them: the cell is
// still settling.
constexpr std::int64_t kMinQuietNs = 5'000'000'000;
// In the quiet phases at least this share of puts succeed, once there are enough to tell.
constexpr double kQuietPutSuccess = 0.99;
constexpr std::uint64_t kMinQuietPuts = 200;

std::vector<Phase> phases_of(std::int64_t from, std::int64_t to,
                             std::vector<std::tuple<std::int64_t, std::int64_t, std::string>> faults,
                             const std::vector<Report::PutCall>& puts);
std::string code_name(int code);
void check(const std::vector<std::string>& logs, Report& report,
           const std::vector<std::pair<std::int64_t, std::int64_t>>& losses);

}  // namespace kvstash::history
