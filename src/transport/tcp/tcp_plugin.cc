// The tcp transport in the registry: its start and its look at this host.
#include <openssl/crypto.h>

#include <fmt/format.h>

#include "transport/registry.h"
#include "transport/tcp/tcp_transport.h"

namespace kvstash::transport::tcp {
namespace {

Result<std::unique_ptr<Transport>> start(const EngineOptions& options) {
  return make_tcp_transport(options.tcp, options.cluster_token, options.busy_poll);
}

std::vector<TransportFinding> probe() {
  return {
      {"transport tcp", TransportFinding::Level::kOk,
       fmt::format("built in (Boost.Asio, TLS by OpenSSL {}); kvstashd --listen sets where a node serves it, "
                   "--tls-cert whether over TLS",
                   OpenSSL_version(OPENSSL_VERSION_STRING)),
       ""}};
}

}  // namespace

const Plugin& plugin() {
  static const Plugin p{TransportKind::kTcp, &start, &probe};
  return p;
}

}  // namespace kvstash::transport::tcp
