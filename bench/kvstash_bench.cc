// kvstash-bench: transfer benchmarks with their references measured in the same run.
#include <CLI/CLI.hpp>

#include <iostream>
#include <sstream>

#include "checksum_bench.h"
#include "churn_bench.h"
#include "common/system.h"
#include "common/units.h"
#include "kvcache_bench.h"
#include "kvstash/types.h"
#include "metadata_bench.h"
#include "p2p_bench.h"
#include "peers_bench.h"
#include "replay_bench.h"
#include "serve_bench.h"
#include "store_bench.h"
#include "tier_bench.h"

namespace {

using namespace kvstash;

// Where a subcommand's cluster token comes from: --token-file FILE, else KVSTASH_CLUSTER_TOKEN,
// else the deprecated --token (its value shows in `ps`: warned). Each is checked (empty or
// shorter than 16 bytes: refused, never taken as "no token").
struct TokenSource {
  std::string file;
  std::string argv_token;
  CLI::Option* file_opt = nullptr;
  CLI::Option* argv_opt = nullptr;

  void add_to(CLI::App* app, const char* what) {
    file_opt = app->add_option(
        "--token-file", file,
        std::string("File holding the cluster token ") + what + " (chmod 600; else KVSTASH_CLUSTER_TOKEN)");
    argv_opt = app->add_option("--token", argv_token,
                               "Deprecated: the token on the command line shows in ps to every user of the "
                               "host; use --token-file or KVSTASH_CLUSTER_TOKEN");
  }

  // The token ("" for none); throws CLI::ValidationError.
  std::string resolve() const {
    if (file_opt->count() > 0) {
      auto t = sys::read_private_secret_file(file);
      if (!t.is_ok()) throw CLI::ValidationError("--token-file", t.status().message());
      Status ok = sys::check_cluster_token(*t, "the token in " + file);
      if (!ok.is_ok()) throw CLI::ValidationError("--token-file", ok.message());
      return *t;
    }
    if (argv_opt->count() > 0) {
      Status ok = sys::check_cluster_token(argv_token, "--token");
      if (!ok.is_ok()) throw CLI::ValidationError("--token", ok.message());
      std::cerr << "kvstash-bench: warning: --token shows the cluster token in ps; use --token-file or "
                   "KVSTASH_CLUSTER_TOKEN\n";
      return argv_token;
    }
    if (const char* env = std::getenv("KVSTASH_CLUSTER_TOKEN"); env != nullptr) {
      Status ok = sys::check_cluster_token(env, "KVSTASH_CLUSTER_TOKEN");
      if (!ok.is_ok()) throw CLI::ValidationError(ok.message());
      return env;
    }
    return {};
  }
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::vector<std::size_t> parse_sizes(const std::string& list) {
  std::vector<std::size_t> sizes;
  for (const auto& s : split(list)) {
    auto v = units::parse_size(s);
    if (!v.is_ok()) throw CLI::ValidationError("--sizes", v.status().message());
    if (*v == 0) throw CLI::ValidationError("--sizes", "a size of at least one byte");
    sizes.push_back(*v);
  }
  if (sizes.empty()) throw CLI::ValidationError("--sizes", "no size given");
  return sizes;
}

std::vector<TransportKind> parse_transports(const std::string& list) {
  auto kinds = parse_transport_list(list);
  if (!kinds.is_ok()) throw CLI::ValidationError("--transport", kinds.status().message());
  return std::move(kinds).value();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvstash-bench: kvstash transfer benchmarks, each row compared with references measured in the same "
      "run"};
  app.require_subcommand(1);

  bench::P2POptions p2p;
  std::string transports = "all", sizes = "4KiB,64KiB,1MiB,16MiB,64MiB,256MiB", ops = "write,read";
  auto* p = app.add_subcommand(
      "p2p", "Point-to-point one-sided READ/WRITE between this process and a target it spawns");
  p->add_option("-t,--transport", transports, "Transports to measure: all, or a list of shm,tcp,ucx")
      ->capture_default_str();
  p->add_option("-s,--sizes", sizes, "Request sizes (comma-separated; units B, KiB, MiB, GiB)")
      ->capture_default_str();
  p->add_option("--op", ops, "Operations: write,read")->capture_default_str();
  p->add_option("--threads", p2p.threads, "Initiator threads submitting concurrently")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  p->add_option("--depth", p2p.depth, "Requests per batch (in flight per thread)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  p->add_option("--seconds", p2p.seconds, "Measuring time per row")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 60.0));
  TokenSource p2p_token;
  p2p_token.add_to(p, "for the tcp handshake (the target it spawns gets it in its environment)");
  p->add_flag("--json", p2p.json, "One JSON object per row");
  p->add_option("--tcp-streams", p2p.tcp.streams, "tcp: parallel connections per peer")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  p->add_option("--tcp-io-threads", p2p.tcp.io_threads,
                "tcp: socket I/O threads in each process (0: one on hosts of up to 4 cores, two above)")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  std::string tcp_slice = "512KiB", shm_slice = "4MiB";
  p->add_option("--tcp-slice", tcp_slice, "tcp: requests above this are striped over the streams")
      ->capture_default_str();
  p->add_option("--shm-copy-threads", p2p.shm.copy_threads, "shm: copy threads of the initiator")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  p->add_option("--shm-slice", shm_slice, "shm: requests above this are split over the copy threads")
      ->capture_default_str();
  p->add_option(
       "--busy-poll-us", p2p.busy_poll_us,
       "Latency mode in both processes: waiting callers and tcp I/O threads spin this many microseconds "
       "before they sleep (EngineOptions::busy_poll); 0 = off")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  p->add_option("--peer", p2p.peer_file,
                "Use a running `kvstash-bench p2p-target` (maybe on another host): a file, or - for stdin, "
                "holding the three lines it printed");
  p->add_option("--plot", p2p.plot, "Also draw GB/s over request size into this SVG file (runs gnuplot)");
  p->add_flag(
      "--tls", p2p.tls,
      "Also measure tcp over TLS (tcp+tls rows beside the plain tcp ones), against a TLS-only listener "
      "of the target (a spawned one gets throwaway credentials)");
  p->add_option("--tls-ca", p2p.tls_ca, "With --tls and --peer: the CA of the target's --tls-cert")
      ->check(CLI::ExistingFile);
  p->footer(
      "Examples:\n  kvstash-bench p2p --transport shm,tcp --sizes 1MiB,64MiB --json\n"
      "  host A: kvstash-bench p2p-target --listen 10.0.0.1:7000 --region 1GiB > target.txt\n"
      "  host B: kvstash-bench p2p --transport tcp --peer target.txt");

  bench::PeersOptions peers;
  std::string peers_transports = "tcp,shm", peers_sizes = "64KiB,1MiB,16MiB,64MiB";
  peers.venv = bench::default_peers_venv();
  auto* pe = app.add_subcommand(
      "peers",
      "kvstash's p2p rows beside peer transfer engines on the same sizes, two processes on this host: "
      "Mooncake's transfer engine (tcp) and NIXL (UCX), from the venv scripts/peers-setup makes");
  pe->add_option("-t,--transport", peers_transports, "kvstash transports to measure: a list of shm,tcp,ucx")
      ->capture_default_str();
  pe->add_option("-s,--sizes", peers_sizes, "Request sizes (comma-separated; units B, KiB, MiB, GiB)")
      ->capture_default_str();
  pe->add_option("--seconds", peers.seconds, "Measuring time per row")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 60.0));
  pe->add_option(
        "--peers", peers.engines,
        "Peer engines: mooncake-tcp, nixl-ucx, nixl-ucx-tcp; in the Soft-RoCE lane (scripts/rdma-vm) "
        "also mooncake-rdma, nixl-ucx-rc")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::IsMember({"mooncake-tcp", "nixl-ucx", "nixl-ucx-tcp", "mooncake-rdma", "nixl-ucx-rc"}));
  pe->add_option("--venv", peers.venv, "The peers' venv (scripts/peers-setup)")
      ->envname("KVSTASH_PEERS_VENV")
      ->capture_default_str();
  pe->add_option("--busy-poll-us", peers.busy_poll_us,
                 "kvstash's latency mode in both processes (as p2p --busy-poll-us); 0 = off")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  pe->add_flag("--json", peers.json, "One JSON object per row, then one per ratio");
  pe->add_option("--plot", peers.plot, "Also draw GB/s over request size into this SVG file (runs gnuplot)");
  pe->footer(
      "Examples:\n  scripts/peers-setup && kvstash-bench peers --plot peers.svg\n"
      "  kvstash-bench peers --transport tcp --peers mooncake-tcp --sizes 1MiB --json");

  std::string region_text = "1GiB", target_transports = "all";
  TcpOptions target_tcp;
  std::string target_token;
  auto* t = app.add_subcommand(
      "p2p-target",
      "The target side of `p2p`, for runs across hosts (p2p spawns one itself on loopback). "
      "Prints its address, key and socket lines, serves until stdin closes");
  t->add_option("--region", region_text, "Registered memory to serve (at least sizes x threads x depth)")
      ->capture_default_str();
  t->add_option("--listen", target_tcp.listen,
                "tcp transport and socket-reference address (numeric IPv4:port)")
      ->capture_default_str();
  t->add_option("--transports", target_transports, "Transports to serve: all, or a list")
      ->capture_default_str();
  TokenSource target_token_source;
  target_token_source.add_to(t, "required from initiators");
  t->add_option("--tcp-io-threads", target_tcp.io_threads, "tcp: socket I/O threads")->capture_default_str();
  t->add_option(
       "--tls-cert", target_tcp.tls.cert_file,
       "Also serve the region over a TLS-only tcp listener with this PEM certificate chain (p2p --tls)")
      ->check(CLI::ExistingFile);
  t->add_option("--tls-key", target_tcp.tls.key_file, "The PEM private key of --tls-cert")
      ->check(CLI::ExistingFile);
  unsigned target_busy_poll_us = 0;
  t->add_option("--busy-poll-us", target_busy_poll_us,
                "Latency mode: spin this many microseconds before sleeping")
      ->capture_default_str();

  bench::StoreBenchOptions store;
  std::string tokens = "256", object_size, backends = "all", capacity, page_size;
  auto* st = app.add_subcommand(
      "store",
      "Offload and restore the KV cache of N sessions through the Store (Redis for metadata, bytes "
      "one-sided), against pushing the same bytes through Redis (HSET/HGET). Starts a private "
      "redis-server and kvstashd unless --redis names a cell");
  st->add_option("--sessions", store.sessions, "Sessions (objects) per round")
      ->capture_default_str()
      ->check(CLI::Range(1u, 65536u));
  st->add_option("--tokens", tokens,
                 "Tokens per session, A or a range A-B (picked per session with a fixed seed), 1..32768; "
                 "a Llama-2-7B token is 512 KiB of KV cache. Ignored with --object-size")
      ->capture_default_str();
  st->add_option("--object-size", object_size, "Every session exactly this size instead (e.g. 64MiB)");
  st->add_option("--backends", backends,
                 "all (kvstash-ucx only when built with UCX, kvstash-verbs only where an RDMA device is "
                 "active), or a list of kvstash-shm,kvstash-tcp,kvstash-ucx,kvstash-verbs,redis-bytes")
      ->capture_default_str();
  st->add_option("--rounds", store.rounds, "Rounds; each puts every session, then gets every one back")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1000u));
  auto* redis_opt = st->add_option("--redis", store.redis_url,
                                   "An existing cell's Redis URL: start no redis-server or kvstashd");
  st->add_option("--redis-password", store.redis_password, "Password of --redis's Redis")
      ->envname("KVSTASH_REDIS_PASSWORD");
  st->add_option("--capacity", capacity, "Pool of the private kvstashd (default: one round's sessions + 25%)")
      ->excludes(redis_opt);
  st->add_option("--page-size", page_size, "Page size of the private kvstashd (default: kvstashd's)")
      ->excludes(redis_opt);
  st->add_flag("--json", store.json, "One JSON object per row");
  st->add_option("--rkey-scope", store.rkey_scope,
                 "verbs: key the pool per connection or per lease (default: the cell's); JSON rows give the "
                 "lease round trips to the node per operation and the time they took")
      ->check(CLI::IsMember({"connection", "lease"}));
  TokenSource store_token;
  store_token.add_to(st, "for the tcp transport");
  st->footer(
      "Examples:\n  kvstash-bench store\n  kvstash-bench store --sessions 4 --tokens 256-4096 --json\n"
      "  kvstash-bench store --object-size 64MiB --backends kvstash-tcp,redis-bytes\n"
      "  kvstash-bench store --redis redis://10.0.0.5:6379/0 --backends kvstash-tcp");

  bench::KvCacheBenchOptions kvc;
  std::string kvc_transports = "shm,tcp";
  auto* kc = app.add_subcommand(
      "kvcache",
      "Save and load one Llama-2-7B session whose blocks are scattered over a paged KV cache, layer by "
      "layer through KvCache, against the same bytes as contiguous objects through the Store. Starts a "
      "private redis-server and kvstashd");
  kc->add_option("--tokens", kvc.tokens, "Tokens in the session (a multiple of 256)")
      ->capture_default_str()
      ->check(CLI::Range(256u, 32768u));
  kc->add_option("--block-size", kvc.block_size, "Tokens per block of the paged cache")
      ->capture_default_str()
      ->check(CLI::IsMember({1u, 2u, 4u, 8u, 16u, 32u, 64u, 128u, 256u}));
  kc->add_option("--rounds", kvc.rounds, "Rounds (each saves, then loads)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 100u));
  kc->add_option("--transport", kvc_transports, "Transports to measure: shm,tcp,ucx")->capture_default_str();
  kc->add_flag("--json", kvc.json, "One JSON object per row");
  kc->add_flag("--gpu", kvc.gpu,
               "Both caches in GPU memory, staged through pinned bounce buffers, against cudaMemcpy "
               "(builds with CUDA; needs a GPU)");
  kc->add_option("--save-tp", kvc.save_tp,
                 "With --load-tp: the session is saved by this many tensor-parallel ranks (keys by KV heads)")
      ->check(CLI::Range(1u, 32u));
  kc->add_flag("--hnd", kvc.hnd,
               "With --save-tp: blocks with heads outermost (HND), as vLLM's CPU backend keeps them");
  kc->add_option("--load-tp", kvc.load_tp,
                 "With --save-tp: and loaded by this many, against a load at the same degree")
      ->check(CLI::Range(1u, 32u));
  kc->footer(
      "Examples:\n  kvstash-bench kvcache\n  kvstash-bench kvcache --tokens 1024 --transport tcp --json\n"
      "  kvstash-bench kvcache --tokens 1024 --save-tp 2 --load-tp 1");

  bench::ServeBenchOptions serve;
  std::string serve_transport = "shm";
  auto* sv = app.add_subcommand(
      "serve",
      "A simulated engine's request stream over kvstash: sessions sharing system prompts come back for "
      "several turns, idle ones are offloaded and restored. Hit rate, restore time per token and bytes "
      "moved, against the same bytes through Redis and recomputation at a stated prefill rate. Starts a "
      "private redis-server and kvstashd");
  sv->add_option("--sessions", serve.sessions, "Sessions")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1024u));
  sv->add_option("--system-prompts", serve.system_prompts, "Distinct system prompts the sessions share")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1024u));
  sv->add_option("--system-tokens", serve.system_tokens, "Tokens of each system prompt")
      ->capture_default_str()
      ->check(CLI::Range(0u, 32768u));
  sv->add_option("--turns", serve.turns, "Turns per session")
      ->capture_default_str()
      ->check(CLI::Range(1u, 100u));
  sv->add_option("--user-tokens", serve.user_tokens, "Tokens of each user message")
      ->capture_default_str()
      ->check(CLI::Range(1u, 32768u));
  sv->add_option("--answer-tokens", serve.answer_tokens, "Tokens of each answer")
      ->capture_default_str()
      ->check(CLI::Range(1u, 32768u));
  sv->add_option("--resident", serve.resident_sessions, "Whole sessions the engine's cache holds")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1024u));
  sv->add_option("--chunk-tokens", serve.chunk_tokens, "Tokens per stored chunk (a multiple of 16)")
      ->capture_default_str();
  sv->add_option("--prefill-rate", serve.prefill_rate,
                 "Tokens/s the engine recomputes at, for the comparison (stated, not measured)")
      ->capture_default_str();
  sv->add_option("--transport", serve_transport, "shm, tcp or ucx")->capture_default_str();
  sv->add_option("--seed", serve.seed, "The stream's seed")->capture_default_str();
  sv->add_flag("--json", serve.json, "One JSON object");
  sv->footer(
      "Examples:\n  kvstash-bench serve\n  kvstash-bench serve --sessions 16 --resident 4 --transport tcp "
      "--json");

  bench::MetadataBenchOptions meta;
  auto* md = app.add_subcommand(
      "metadata",
      "Metadata operations per second against one private redis-server: N clients, each on its own "
      "connection, putting, getting and asking contains_prefix, next to redis-benchmark's SET, GET, "
      "EVALSHA and FCALL on the same Redis in the same run. With --scripts: how long each script holds Redis "
      "(server time, from SLOWLOG) in a cell of many objects");
  md->add_option("--clients", meta.clients, "Client counts, one group of rows each (comma-separated)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  md->add_option("--seconds", meta.seconds, "Measuring time of the mix per client count")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 60.0));
  md->add_flag("--scripts", meta.scripts,
               "Instead: server time per script (get, put, eviction, a blocked put, contains_prefix, "
               "sweeping a dead node, re-registration) in a cell of --objects objects");
  md->add_option("--objects", meta.objects, "--scripts: one-page objects in the cell")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{10000}, std::uint64_t{20000000}));
  md->add_flag(
      "--tls", meta.tls,
      "Throughput: the kvstash clients reach Redis through a TLS port of the same server (rediss://, "
      "throwaway certificates); redis-benchmark's references stay plain");
  md->add_option(
        "--quotas", meta.quotas,
        "Throughput: set this many quotas per key prefix first (one over the gets' keys, one over the "
        "puts', the rest over other prefixes; none ever full): what quota accounting costs")
      ->capture_default_str()
      ->check(CLI::Range(0, 256));
  md->add_flag("--features", meta.features,
               "Instead: the mix at the first --clients count with the cell's features turned on one by one "
               "in one run (none; grants signed per node; 4 quotas; the arc policy; turn-ttl): what each "
               "costs an operation");
  md->add_option("--shards", meta.shards,
                 "Instead: the mix over a Redis Cluster of each shard count listed (one master per shard, "
                 "one cell per shard, clients spread over the cells), for how ops/s scale with shards")
      ->delimiter(',')
      ->check(CLI::Range(1, 16));
  md->add_option("--policy", meta.policy, "--scripts: the cell's eviction policy (kvstash policy)")
      ->capture_default_str()
      ->check(CLI::IsMember({"lru", "arc", "turn-ttl"}));
  md->add_flag("--json", meta.json, "One JSON object per row (--scripts: the table as one JSON object too)");
  md->footer(
      "Examples:\n  kvstash-bench metadata --clients 1,4,16,64 --seconds 2\n"
      "  kvstash-bench metadata --scripts --objects 1000000\n"
      "  kvstash-bench metadata --shards 1,3 --clients 6,24");

  bench::ChecksumBenchOptions sums;
  std::string sum_bytes = "64MiB";
  auto* cs = app.add_subcommand(
      "checksum",
      "The object checksum (the xxh3 tree) on this host's CPU, on 1..N threads, against memcpy and "
      "libxxhash's streaming XXH3-64 of the same bytes");
  cs->add_option("--bytes", sum_bytes, "Bytes hashed per round")->capture_default_str();
  cs->add_option("--rounds", sums.rounds, "Rounds per row")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1000u));
  cs->add_option("--threads", sums.threads, "Rows for 1..N threads")
      ->capture_default_str()
      ->check(CLI::Range(1u, 64u));
  cs->add_flag("--json", sums.json, "One JSON object per row");
  cs->footer("Example:\n  kvstash-bench checksum --bytes 256MiB --threads 2");

  bench::ReplayBenchOptions replay;
  std::string replay_block_bytes = "16KiB", replay_transport = "shm", replay_saves = "connector";
  auto* rp = app.add_subcommand(
      "replay",
      "A production trace (JSON lines of requests and their chained prompt blocks) through a real cell "
      "(a private Redis and kvstashd on loopback), each request's prefix lookup, loads and saves as a "
      "connector makes them, beside the in-process model of each eviction policy at the same capacity, "
      "Belady's offline rule as the bound: token hit rates, latencies, bytes moved and a TTFT estimate");
  rp->add_option("--trace", replay.trace, "The trace (../shared/traces/kimi-conversation.jsonl's format)")
      ->required();
  rp->add_option("--capacities", replay.capacities, "Cache capacities, in blocks")
      ->delimiter(',')
      ->capture_default_str();
  rp->add_option("--requests", replay.requests, "The first N requests (0: all)")->capture_default_str();
  rp->add_option("--block-tokens", replay.block_tokens, "Tokens a block of the trace holds")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  rp->add_option(
        "--saves", replay_saves,
        "connector: only whole blocks are looked up and saved, every block from the hit on is put "
        "(as kvstash's connectors do); every-block: the partial last block too, a held block not put "
        "again (as the trace's README counts)")
      ->capture_default_str()
      ->check(CLI::IsMember({"connector", "every-block"}));
  rp->add_flag("--model-only", replay.model_only, "The model's rows alone: no cell");
  rp->add_option(
        "--tier-capacities", replay.tier_capacities,
        "NVMe tier capacities, in blocks: the model of a pool of each --capacities over a tier of each, "
        "and (unless --model-only) a cell whose node runs such a tier under LRU (kvstashd --ssd)")
      ->delimiter(',');
  rp->add_option(
        "--tier-dir", replay.tier_dir,
        "Where a cell's NVMe tier file goes (removed afterwards; its file system must take O_DIRECT)")
      ->capture_default_str();
  std::vector<std::string> replay_cell_policies{"lru"};
  rp->add_option(
        "--cell-policies", replay_cell_policies,
        "The eviction policies (kvstash policy) a cell replays the trace under, each in a cell of its own")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::IsMember({"lru", "arc", "turn-ttl"}));
  rp->add_option("--block-bytes", replay_block_bytes,
                 "Bytes of a block in the cell (a power of two: one page of the node)")
      ->capture_default_str();
  rp->add_option("--transport", replay_transport, "shm, tcp or ucx")->capture_default_str();
  rp->add_option("--speed", replay.speed,
                 "Issue requests at the trace's times divided by this (0: each as soon as the last ended)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  rp->add_option("--prefill-tokens-per-s", replay.prefill_tokens_per_s,
                 "The TTFT estimate's prefill speed, in tokens per second")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  rp->add_option(
        "--kv-bytes-per-token", replay.kv_bytes_per_token,
        "The TTFT estimate's KV bytes per token (131072: an 8B model of 32 layers, 8 KV heads, bf16)")
      ->capture_default_str();
  rp->add_flag("--json", replay.json, "One JSON object per row");
  rp->add_option("--plot", replay.plot, "Write an SVG of the token hit rate over capacity (gnuplot)");
  rp->footer(
      "Examples:\n  kvstash-bench replay --trace ../shared/traces/kimi-conversation.jsonl\n"
      "  kvstash-bench replay --trace ../shared/traces/kimi-conversation.jsonl --model-only --capacities "
      "1000,2000,4000,6000,10000,20000,40000 --plot hit-rate.svg");

  bench::TierBenchOptions tier;
  std::string tier_bytes = "1GiB", tier_io = "4MiB";
  auto* ti = app.add_subcommand(
      "tier",
      "The NVMe tier's device layer (O_DIRECT through io_uring) writing and reading a file sequentially, "
      "against fio's O_DIRECT io_uring job of the same file in the same run");
  ti->add_option("--path", tier.path, "A file on the tier's file system (created, and removed after)")
      ->required();
  ti->add_option("--bytes", tier_bytes, "The file's size: each pass writes, then reads, all of it")
      ->capture_default_str();
  ti->add_option("--io-size", tier_io, "One I/O (a page)")->capture_default_str();
  ti->add_option("--depth", tier.depth, "I/Os in flight")->capture_default_str()->check(CLI::Range(1u, 256u));
  ti->add_option("--rounds", tier.rounds, "Passes of each; the best counts")
      ->capture_default_str()
      ->check(CLI::Range(1u, 100u));
  ti->add_flag("--json", tier.json, "One JSON object per row");
  bench::TierStoreBenchOptions tier_store;
  bool tier_store_on = false, tier_no_checksum = false;
  std::string tier_sizes = "4MiB,64MiB", tier_pool = "256MiB", tier_page = "4MiB";
  ti->add_flag(
      "--store", tier_store_on,
      "The tier under a real kvstashd instead: puts (paced by the write-down), write-down and promoted "
      "gets (checked byte for byte), against fio's write and read on the same file system");
  ti->add_option("--object-sizes", tier_sizes, "--store: object sizes, a run each")->capture_default_str();
  ti->add_option("--pool", tier_pool, "--store: the node's DRAM pool")->capture_default_str();
  ti->add_option("--page-size", tier_page, "--store: the cell's page (and fio's I/O)")->capture_default_str();
  ti->add_option("--pools", tier_store.pools_of_objects, "--store: objects put, in pools' worth")
      ->capture_default_str()
      ->check(CLI::Range(2u, 64u));
  ti->add_option("--sessions", tier_store.sessions, "--store: promoted gets at once")
      ->capture_default_str()
      ->check(CLI::Range(1u, 64u));
  ti->add_flag("--no-checksum", tier_no_checksum,
               "--store: the store's checksum off (the tier checks its own sum)");
  ti->footer(
      "Examples:\n  kvstash-bench tier --path /mnt/nvme0/bench.tier --bytes 4GiB --io-size 4MiB --depth 16\n"
      "  kvstash-bench tier --store --path /mnt/nvme0/bench.tier --object-sizes 4MiB,64MiB --pool 1GiB");

  bench::ChurnBenchOptions churn;
  std::string churn_sizes = "mixed", churn_mix = "put=1", churn_capacity = "64MiB", churn_page = "1MiB",
              churn_transport = "shm";
  auto* ch = app.add_subcommand(
      "churn",
      "A cache full all the time: clients put (get, stream, remove, touch) objects over keys whose working "
      "set is several times the pool, so nearly every put evicts or replaces. Reports over time put "
      "success, stored bytes over pool bytes (efficiency), evictions/s, pages reserved and in limbo, and "
      "the hit ratio; every hit is compared byte for byte. Starts a private redis-server and kvstashds");
  ch->add_option("--sizes", churn_sizes,
                 "Object sizes, log-uniform: mixed (4KiB-8MiB), kv (KV-cache chunks, 1MiB-128MiB) or MIN-MAX")
      ->capture_default_str();
  ch->add_option("--nodes", churn.nodes, "Memory nodes")->capture_default_str()->check(CLI::Range(1u, 16u));
  ch->add_option("--node-capacity", churn_capacity, "Pool of each node")->capture_default_str();
  ch->add_option("--page-size", churn_page, "Page size of the nodes")->capture_default_str();
  ch->add_option("--ssd-dir", churn.ssd_dir,
                 "Give each node an NVMe tier: a file in this directory (a file system with O_DIRECT)");
  std::string churn_ssd_capacity;
  ch->add_option("--ssd-capacity", churn_ssd_capacity, "Each node's tier (default: eight pools)");
  ch->add_option("--keys", churn.keys,
                 "Keys the clients write over (0: three times the pool at the mean size)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1000000u));
  ch->add_option("--clients", churn.clients, "Client threads (one Store)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 64u));
  ch->add_option("--seconds", churn.seconds, "Length of the run")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 86400.0));
  ch->add_option("--interval", churn.interval, "Seconds per reported row")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 600.0));
  ch->add_option("--mix", churn_mix,
                 "Operation weights: put, stream, get, remove, touch (put=4,get=3,stream=1)")
      ->capture_default_str();
  ch->add_option("--ttl-fraction", churn.ttl_fraction, "Puts with a TTL of 0.2-2 s")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  ch->add_option("--short-deadline-fraction", churn.short_deadline_fraction,
                 "Puts with a deadline 1-50 ms from their start")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  ch->add_option("--cancel-fraction", churn.cancel_fraction,
                 "Stream puts aborted midway, and gets cancelled from another thread")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  ch->add_option("--transport", churn_transport, "shm, tcp or ucx")->capture_default_str();
  ch->add_option("--seed", churn.seed, "The clients' seed")->capture_default_str();
  ch->add_option("--min-put-success", churn.min_put_success,
                 "Exit 1 when the run's put success is below this")
      ->check(CLI::Range(0.0, 1.0));
  ch->add_flag("--json", churn.json, "One JSON object per interval, then a summary");
  ch->add_option("--plot", churn.plot,
                 "Also draw efficiency, put success and limbo over time (SVG, gnuplot)");
  ch->footer(
      "Examples:\n  kvstash-bench churn --seconds 45 --keys 20   (few keys, each overwritten over and over)\n"
      "  kvstash-bench churn --mix put=4,stream=1,get=4,remove=1,touch=1 --cancel-fraction 0.1\n"
      "  kvstash-bench churn --sizes kv --nodes 2 --node-capacity 1GiB --page-size 4MiB --keys 40 --plot "
      "churn.svg");

  std::vector<TransportKind> target_kinds;
  try {
    app.parse(argc, argv);
    if (p->parsed()) p2p.token = p2p_token.resolve();
    if (t->parsed()) target_token = target_token_source.resolve();
    if (st->parsed()) store.token = store_token.resolve();
    if (t->parsed()) target_kinds = parse_transports(target_transports);
    if (cs->parsed()) {
      auto v = units::parse_size(sum_bytes);
      if (!v.is_ok() || *v == 0) throw CLI::ValidationError("--bytes", "a size of at least one byte");
      sums.bytes = *v;
    }
    if (ch->parsed()) {
      if (Status s = bench::parse_churn_sizes(churn_sizes, &churn); !s.is_ok()) {
        throw CLI::ValidationError("--sizes", s.message());
      }
      if (Status s = bench::parse_churn_mix(churn_mix, &churn); !s.is_ok()) {
        throw CLI::ValidationError("--mix", s.message());
      }
      auto cap = units::parse_size(churn_capacity), page = units::parse_size(churn_page);
      if (!cap.is_ok() || *cap == 0) throw CLI::ValidationError("--node-capacity", "a size, such as 64MiB");
      if (!page.is_ok() || *page == 0 || (*page & (*page - 1)) != 0) {
        throw CLI::ValidationError("--page-size", "a power of two (kvstashd's rule)");
      }
      churn.node_capacity = *cap;
      churn.page_size = *page;
      if (!churn_ssd_capacity.empty()) {
        auto sc = units::parse_size(churn_ssd_capacity);
        if (!sc.is_ok()) throw CLI::ValidationError("--ssd-capacity", "a size, such as 512MiB");
        churn.ssd_capacity = *sc;
      }
      const auto kinds = parse_transports(churn_transport);
      if (kinds.size() != 1) throw CLI::ValidationError("--transport", "one of shm, tcp, ucx");
      churn.transport = kinds.front();
    }
    if (kc->parsed()) kvc.transports = parse_transports(kvc_transports);
    if (rp->parsed()) {
      const auto kinds = parse_transports(replay_transport);
      if (kinds.size() != 1) throw CLI::ValidationError("--transport", "one of shm, tcp, ucx");
      replay.transport = kinds.front();
      auto bytes = units::parse_size(replay_block_bytes);
      if (!bytes.is_ok() || *bytes == 0 || (*bytes & (*bytes - 1)) != 0) {
        throw CLI::ValidationError("--block-bytes", "a power of two, such as 16KiB");
      }
      replay.block_bytes = *bytes;
      replay.saves =
          replay_saves == "connector" ? bench::ReplaySaves::kConnector : bench::ReplaySaves::kEveryBlock;
      replay.cell_policies.clear();
      for (const auto& name : replay_cell_policies) {
        replay.cell_policies.push_back(name == "arc"        ? bench::ReplayPolicy::kArc
                                       : name == "turn-ttl" ? bench::ReplayPolicy::kTurnTtl
                                                            : bench::ReplayPolicy::kLru);
        if (name == "turn-ttl" && !(replay.speed > 0) && !replay.model_only) {
          throw CLI::ValidationError(
              "--cell-policies",
              "turn-ttl keeps blocks for times learned on the trace's clock: give --speed "
              "(the cell's policy clock then runs that many times as fast)");
        }
      }
    }
    if (sv->parsed()) {
      const auto kinds = parse_transports(serve_transport);
      if (kinds.size() != 1) throw CLI::ValidationError("--transport", "one of shm, tcp, ucx");
      serve.transport = kinds.front();
    }
    if (st->parsed()) {
      if (Status s = bench::parse_token_range(tokens, &store); !s.is_ok()) {
        throw CLI::ValidationError("--tokens", s.message());
      }
      auto b = bench::parse_backends(backends);
      if (!b.is_ok()) throw CLI::ValidationError("--backends", b.status().message());
      store.backends = *b;
      auto size_option = [](const std::string& name, const std::string& text, std::uint64_t* out) {
        if (text.empty()) return;
        auto v = units::parse_size(text);
        if (!v.is_ok()) throw CLI::ValidationError(name, v.status().message());
        if (*v == 0) throw CLI::ValidationError(name, "must be more than 0 bytes");
        *out = *v;
      };
      size_option("--object-size", object_size, &store.object_size);
      size_option("--capacity", capacity, &store.capacity);
      size_option("--page-size", page_size, &store.page_size);
      if ((store.page_size & (store.page_size - 1)) != 0) {
        throw CLI::ValidationError("--page-size", "must be a power of two (kvstashd's rule)");
      }
    }
    if (p->parsed()) {
      p2p.transports = parse_transports(transports);
      p2p.sizes = parse_sizes(sizes);
      auto ts = units::parse_size(tcp_slice), ss = units::parse_size(shm_slice);
      if (!ts.is_ok()) throw CLI::ValidationError("--tcp-slice", ts.status().message());
      if (!ss.is_ok()) throw CLI::ValidationError("--shm-slice", ss.status().message());
      p2p.tcp.slice_bytes = *ts;
      p2p.shm.slice_bytes = *ss;
      p2p.ops.clear();
      for (const auto& s : split(ops)) {
        if (s == "read")
          p2p.ops.push_back(TransferOp::kRead);
        else if (s == "write")
          p2p.ops.push_back(TransferOp::kWrite);
        else
          throw CLI::ValidationError("--op", "unknown op '" + s + "' (read, write)");
      }
    }
    if (pe->parsed()) {
      peers.transports = parse_transports(peers_transports);
      peers.sizes = parse_sizes(peers_sizes);
    }
  } catch (const CLI::ParseError& e) {
    // --help exits 0; every usage error exits 2, as the kvstash tools document.
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (t->parsed()) {
    auto region = units::parse_size(region_text);
    if (!region.is_ok() || *region == 0) {
      std::cerr << "--region: " << region.status().message() << "\n";
      return 2;
    }
    return bench::run_p2p_target(*region, target_kinds, target_tcp, target_token, target_busy_poll_us);
  }
  if (st->parsed()) return bench::run_store(store);
  if (kc->parsed() && kvc.gpu) {
#if KVSTASH_BENCH_GPU
    return bench::run_kvcache_gpu(kvc);
#else
    std::cerr << "kvstash-bench kvcache --gpu: this build has no CUDA (meson -Dcuda=enabled with nvcc)\n";
    return 2;
#endif
  }
  if (kc->parsed() && (kvc.save_tp != 0 || kvc.load_tp != 0)) {
    if (kvc.save_tp == 0 || kvc.load_tp == 0 || kvc.gpu) {
      std::cerr << "kvstash-bench kvcache: --save-tp and --load-tp go together, on host caches\n";
      return 2;
    }
    return bench::run_kvcache_tp(kvc);
  }
  if (kc->parsed()) return bench::run_kvcache(kvc);
  if (sv->parsed()) return bench::run_serve(serve);
  if (md->parsed()) return bench::run_metadata(meta);
  if (cs->parsed()) return bench::run_checksum(sums);
  if (rp->parsed()) return bench::run_replay(replay);
  if (ti->parsed() && tier_store_on) {
    tier_store.path = tier.path;
    tier_store.json = tier.json;
    tier_store.depth = tier.depth;
    tier_store.verify_checksum = !tier_no_checksum;
    auto pool = units::parse_size(tier_pool), page = units::parse_size(tier_page);
    if (!pool.is_ok() || !page.is_ok()) {
      std::cerr << "tier --store: --pool and --page-size are sizes\n";
      return 2;
    }
    tier_store.pool = *pool;
    tier_store.page = *page;
    tier_store.object_sizes.clear();
    for (std::string_view rest = tier_sizes; !rest.empty();) {
      const std::size_t comma = rest.find(',');
      auto sz = units::parse_size(std::string(rest.substr(0, comma)));
      if (!sz.is_ok() || *sz == 0) {
        std::cerr << "tier --store: --object-sizes is a list of sizes\n";
        return 2;
      }
      tier_store.object_sizes.push_back(*sz);
      rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    }
    return bench::run_tier_store(tier_store);
  }
  if (ti->parsed()) {
    auto b = units::parse_size(tier_bytes), io = units::parse_size(tier_io);
    if (!b.is_ok() || !io.is_ok() || *io == 0 || *io % 4096 != 0 || *b < *io) {
      std::cerr << "tier: --bytes and --io-size are sizes, the I/O a multiple of 4 KiB and at most --bytes\n";
      return 2;
    }
    tier.bytes = *b / *io * *io;
    tier.io_bytes = *io;
    return bench::run_tier(tier);
  }
  if (ch->parsed()) return bench::run_churn(churn);
  if (pe->parsed()) return bench::run_peers(peers);
  return bench::run_p2p(p2p);
}
