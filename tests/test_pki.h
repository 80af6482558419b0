// A throwaway PKI for TLS tests, made with the openssl CLI in a temporary folder: a CA, a
// server certificate for 127.0.0.1 and localhost, a client certificate, and a second CA that
// signed none of them. Removed with the object.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvstash::test {

class TestPki {
 public:
  TestPki() {
    char dir[] = "/tmp/kvstash-pki-XXXXXX";
    if (::mkdtemp(dir) == nullptr) return;
    dir_ = dir;
    // P-256 keys: quick to make; certificates valid for two days.
    const std::string script = "cd '" + dir_ + "' && (" + R"(
      key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"; }
      ca() { key "$1.key" && openssl req -x509 -new -key "$1.key" -out "$1.crt" -days 2 -subj "/CN=$1"; }
      leaf() {  # name ca subject-alt-names
        key "$1.key" && openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$1" &&
        printf 'subjectAltName=%s\n' "$3" > "$1.ext" &&
        openssl x509 -req -in "$1.csr" -CA "$2.crt" -CAkey "$2.key" -CAcreateserial -out "$1.crt" -days 2 \
          -extfile "$1.ext"
      }
      ca ca && ca other-ca &&
      leaf server ca 'IP:127.0.0.1,DNS:localhost' &&
      leaf client ca 'DNS:kvstash-client'
    ) >/dev/null 2>&1)";
    ok_ = std::system(script.c_str()) == 0;
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
  // "<dir>/<name>": ca.crt, other-ca.crt, server.crt, server.key, client.crt, client.key.
  std::string file(const std::string& name) const { return dir_ + "/" + name; }

 private:
  std::string dir_;
  bool ok_ = false;
};

}  // namespace kvstash::test
