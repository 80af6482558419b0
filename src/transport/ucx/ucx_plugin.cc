// The ucx transport in the registry: its start and its look at this host (UCX's version and
// the transport resources UCX_TLS may choose from).
#include <ucp/api/ucp.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "transport/registry.h"
#include "transport/ucx/ucx_library.h"
#include "transport/ucx/ucx_transport.h"

namespace kvstash::transport::ucx {
namespace {

Result<std::unique_ptr<Transport>> start(const EngineOptions& options) {
  if (!library().available()) return Status::unsupported("ucx transport unavailable: " + library().error());
  return make_ucx_transport(options.ucx, options.cluster_token);
}

// UCX's transport resources as "tl/device" (tcp/eth0, rc_mlx5/mlx5_0:1...), from its own
// context report.
std::string resources() {
  ucp_config_t* config = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return {};
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  ucp_context_h ctx = nullptr;
  const ucs_status_t st = ucp_init(&params, config, &ctx);
  ucp_config_release(config);
  if (st != UCS_OK) return {};
  char* buf = nullptr;
  std::size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f != nullptr) {
    ucp_context_print_info(ctx, f);
    std::fclose(f);
  }
  ucp_cleanup(ctx);
  std::string out;
  std::istringstream in(buf != nullptr ? std::string(buf, len) : std::string());
  std::free(buf);
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("flags -- ");
    if (line.find("resource") == std::string::npos || at == std::string::npos) continue;
    std::string tl = line.substr(at + 9);
    while (!tl.empty() && (tl.back() == ' ' || tl.back() == '\r')) tl.pop_back();
    if (tl.rfind("self/", 0) == 0) continue;  // loopback within one process
    if (!out.empty()) out += ", ";
    out += tl;
  }
  return out;
}

std::vector<TransportFinding> probe() {
  if (!library().available()) {
    return {{"transport ucx", TransportFinding::Level::kInfo,
             "ucx transport unavailable: " + library().error(),
             "needed only for the ucx transport; verbs, tcp and shm do not use UCX"}};
  }
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  const std::string found = resources();
  const bool rdma = found.find("rc_") != std::string::npos || found.find("dc_") != std::string::npos ||
                    found.find("ud_") != std::string::npos;
  return {{"transport ucx", TransportFinding::Level::kOk,
           "UCX " + std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release) +
               ": " + (found.empty() ? "no transport resources" : found) +
               (rdma ? "" : " (no RDMA transport: UCX emulates RMA over tcp here)"),
           ""}};
}

}  // namespace

const Plugin& plugin() {
  static const Plugin p{TransportKind::kUcx, &start, &probe};
  return p;
}

}  // namespace kvstash::transport::ucx
