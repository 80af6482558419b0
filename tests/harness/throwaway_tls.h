// Throwaway TLS credentials for tests and benchmarks on loopback: a CA, a node certificate and
// a client certificate signed by it, written as PEM files into a directory. The keys lie there
// unencrypted: never for a real cell (docs/operations.md shows how to make real ones).
#pragma once

#include <string>

#include "kvstash/types.h"

namespace kvstash::harness {

struct ThrowawayTls {
  std::string ca_cert;      // the CA's certificate: TcpTlsOptions::ca_file / client_ca_file
  std::string server_cert;  // a node's: subjectAltName IP:127.0.0.1, IP:::1, DNS:localhost
  std::string server_key;
  std::string client_cert;  // a client's, for nodes that require one
  std::string client_key;
};

// Makes a fresh CA (its own key, named `ca_name`) and the two certificates it signs, valid
// from an hour ago for a day, into `dir` (which must exist). EC P-256 keys, SHA-256
// signatures. Errors: kIoError (a file cannot be written), kInternal (OpenSSL failed).
Result<ThrowawayTls> make_throwaway_tls(const std::string& dir,
                                        const std::string& ca_name = "kvstash throwaway CA");

}  // namespace kvstash::harness
