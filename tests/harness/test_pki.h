// A throwaway PKI for the TLS-to-Redis tests, in a temporary folder removed with the object:
// a CA with a server certificate (127.0.0.1, ::1, localhost) and a client certificate
// (tests/harness/throwaway_tls.h), and a second CA that signed neither.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>

#include "tests/harness/throwaway_tls.h"

namespace kvstash::test {

class TestPki {
 public:
  TestPki() {
    char dir[] = "/tmp/kvstash-pki-XXXXXX";
    if (::mkdtemp(dir) == nullptr) return;
    dir_ = dir;
    const std::string other = dir_ + "/other";
    std::filesystem::create_directory(other);
    auto ours = harness::make_throwaway_tls(dir_);
    auto theirs = harness::make_throwaway_tls(other, "another CA");
    if (!ours.is_ok() || !theirs.is_ok()) return;
    files_ = {{"ca.crt", ours->ca_cert},        {"server.crt", ours->server_cert},
              {"server.key", ours->server_key}, {"client.crt", ours->client_cert},
              {"client.key", ours->client_key}, {"other-ca.crt", theirs->ca_cert}};
    ok_ = true;
  }
  ~TestPki() {
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }
  TestPki(const TestPki&) = delete;
  TestPki& operator=(const TestPki&) = delete;

  bool ok() const { return ok_; }
  // ca.crt, other-ca.crt, server.crt, server.key, client.crt, client.key; any other name is a
  // path in the folder where nothing is.
  std::string file(const std::string& name) const {
    auto it = files_.find(name);
    return it != files_.end() ? it->second : dir_ + "/" + name;
  }

 private:
  std::string dir_;
  std::map<std::string, std::string> files_;
  bool ok_ = false;
};

}  // namespace kvstash::test
