// kvstash/transfer.h: the data plane's vocabulary, shared by the engine and its transports.
//
// What a transfer is made of below the engine's objects: how a region may be reached
// (Access), ranges of a peer's address space, the counters transports keep, and each
// transport's options. kvstash/engine.h builds Engine, Peer and MemoryHandle on these words;
// a transport (src/transport/*) includes this header and never the engine's.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvstash/types.h"

namespace kvstash {

enum class Access : std::uint8_t {
  kLocal,   // source or destination of this process's own transfers only
  kRemote,  // peers holding the remote key may also READ and WRITE it
  // Peers reach it only through leases (Peer::lease), which this process can fence
  // (Engine::fence) and peers can revoke with confirmation (Peer::revoke): tcp checks the
  // lease on every request, verbs binds a memory window per leased range (the region's own
  // rkey grants nothing remote), shm checks it before every copy. UCX has no leases and
  // serves such a region only with UcxOptions::allow_emulated_rma (tests), unfenced. Memory
  // nodes register their pools this way.
  kLeased,
};

// A range of a peer's address space, inside a region it registered.
struct RemoteRange {
  std::uint64_t addr = 0;
  std::uint64_t length = 0;
};

// The most ranges one Peer::lease may carry (one message to the peer).
inline constexpr std::size_t kMaxLeaseRanges = 1024;

// One monotonic count a transport keeps ("remote_access_errors", "leases_granted", ...).
struct TransportCounter {
  TransportKind transport{};
  std::string name;  // snake_case, unique within the transport
  std::string help;  // one line, for /metrics
  std::uint64_t value = 0;
};

// What a transport finds on this host without starting (`kvstash doctor`, Engine's
// probe_transports): a device and its state, a version, a missing piece and how to add it.
struct TransportFinding {
  enum class Level : std::uint8_t { kOk, kInfo, kWarn, kFail };
  std::string check;  // what was looked at: "transport tcp", "rdma mlx5_0 port 1"
  Level level = Level::kInfo;
  std::string detail;  // what was found, one line
  std::string fix;     // how to fix it; empty when nothing is wrong
};

// TLS on the tcp transport (OpenSSL; TLS 1.2 at least, 1.3 preferred). Both halves are off by
// default. Paths name PEM files, read when the transport starts (unreadable or mismatched
// files: Engine::create fails with kInvalidArgument). Peers are always verified: there is no
// setting that accepts any certificate.
struct TcpTlsOptions {
  // Serving side. With a certificate chain (leaf first) and its private key, the listener
  // speaks TLS only: a plain client is told so and refused (kUnsupported).
  std::string cert_file;
  std::string key_file;
  // Serving side: CA bundle clients' certificates must chain to (mutual TLS). Empty: clients
  // present none.
  std::string client_ca_file;
  // Connecting side. With a CA bundle, this engine connects to every tcp peer over TLS and
  // requires its certificate to chain to this bundle and to name the peer (server_name, else
  // the host of the peer's address, IP or DNS). Empty: plain tcp, unless the environment
  // names one (KVSTASH_TLS_CA, for clients whose options are not plumbed; see
  // src/transport/tcp/README.md). A TLS client meeting a plain node fails with kUnsupported.
  std::string ca_file;
  // Connecting side: the certificate and key this engine presents when a node asks for one.
  std::string client_cert_file;
  std::string client_key_file;
  // Connecting side: the name the node's certificate must carry (and the SNI sent). Empty:
  // the host of the address the node advertises.
  std::string server_name;
};

struct TcpOptions {
  // host:port the engine serves one-sided requests on. Port 0 picks a free port. Loopback
  // by default: serving the LAN is the operator's explicit choice.
  std::string listen = "127.0.0.1:0";
  // Address peers should connect to, when it differs from `listen` (0.0.0.0, NAT). Empty:
  // the listening address.
  std::string advertise;
  // Parallel TCP connections per peer; a large transfer is striped across them.
  std::uint32_t streams = 4;
  // Threads running the socket I/O (both the serving and the initiating side). 0: one on a
  // host of up to 4 cores, two above. A second thread costs a small request a hand-off
  // between the threads (27 against 20 us p50 for 4 KiB on 2 cores, docs/benchmarks.md) and
  // pays off only where cores are spare.
  std::uint32_t io_threads = 0;
  // Transfers longer than this are cut into slices spread over the streams (512 KiB: a
  // 1 MiB transfer already uses two streams; measured in docs/benchmarks.md).
  std::size_t slice_bytes = 512u << 10;
  // A target drops a connection whose request payload does not move for this long, so a
  // stalled initiator cannot hold a region (and its deregistration) hostage.
  std::chrono::milliseconds io_timeout{30000};
  // A target drops a connection that sent no request for this long; initiators connect again
  // when they next need one.
  std::chrono::milliseconds idle_timeout{300000};
  // A target serves at most this many connections that proved the cluster token (or, without
  // a token, finished the handshake), and this many from one peer address; more are closed as
  // soon as they are accepted (or, past the handshake, refused with kUnavailable), so one
  // client cannot take every file descriptor. Each initiator opens `streams`.
  std::uint32_t max_connections = 1024;
  std::uint32_t max_connections_per_peer = 256;
  // Connections still in the handshake have a budget of their own, so a flood of them
  // (unauthenticated: they have proven nothing yet) never takes the slots of clients that
  // proved the token. When it is full, the oldest handshake in progress is dropped for the
  // newcomer: a client that answers at once always gets through, while a flood only cycles
  // its own connections.
  std::uint32_t max_unproven_connections = 64;
  // A connection that has not finished the handshake this long after it was accepted is
  // closed.
  std::chrono::milliseconds handshake_timeout{2000};
  // Failed cluster-token proofs back their address off, and the listener checks few proofs a
  // second from addresses that have not proven the token (src/common/admission.h), so that
  // guessing the token costs time. false only for harnesses that fail handshakes on purpose
  // from one address and then need a good one through at once (the tcp target fuzzer).
  bool guess_backoff = true;
  // TLS for the bytes in transit (off by default): what this engine serves, what it connects
  // with. Costs CPU per byte on both sides (docs/benchmarks.md).
  TcpTlsOptions tls;
};

struct ShmOptions {
  // Directory of the UNIX socket peers fetch region file descriptors from; created 0700.
  // Empty: $XDG_RUNTIME_DIR/kvstash, else /tmp/kvstash-<uid>.
  std::string socket_dir;
  // Threads copying bytes; a large transfer is split over them.
  std::uint32_t copy_threads = 2;
  // Transfers longer than this are split over the copy threads.
  std::size_t slice_bytes = 4u << 20;
  // A batch whose ops are all at most this long is copied by the submitting thread:
  // handing it to a copy thread and back costs more than the copy.
  std::size_t inline_bytes = 2u << 20;
};

struct UcxOptions {
  // Run UCP progress on a dedicated thread (true) or from the thread that waits (false).
  bool progress_thread = true;
  // Optional UCX_TLS-style transport list for this context ("" = UCX's default choice).
  std::string transports;
  // Without RDMA hardware UCX 1.13 emulates put/get over TCP and checks no remote key: a
  // connected peer could write anywhere in this process. Regions are then registered for
  // local use only unless this is set (tests and benchmarks on machines without RDMA).
  bool allow_emulated_rma = false;
};

struct VerbsOptions {
  // RDMA devices to use ("mlx5_0"); empty: KVSTASH_RDMA_DEVICES, else every device with an
  // active port. A connection gets one queue pair (lane) per device that reaches the peer,
  // paired rail by rail (our i-th device with the peer's i-th), and stripes large ops over
  // them.
  std::vector<std::string> devices;
  // At most this many devices (0: all), those on the NUMA node of the thread that creates
  // the engine first.
  std::size_t max_devices = 0;
  // With several devices, ops longer than this are cut into slices spread over the lanes.
  std::size_t stripe_bytes = 1u << 20;
  // host:port of the TCP listener that sets up queue pairs (the bytes themselves go over
  // RDMA). Port 0 picks a free port. Loopback by default, like tcp.
  std::string listen = "127.0.0.1:0";
  // Address peers should connect to for queue-pair setup, when it differs from `listen`.
  std::string advertise;
  // The setup listener serves every connection at once. A connection that has not finished
  // the handshake (hellos and the cluster token) this long after it was accepted is closed,
  // so silent or slow clients cost a socket for at most this long and delay no one else.
  std::chrono::milliseconds handshake_timeout{2000};
  // Once a queue pair is up, a lease message must arrive whole, and its answer be taken,
  // within this from its first byte; else the connection (and its leases) is dropped.
  std::chrono::milliseconds message_timeout{2000};
  // The listener keeps at most this many setup connections in all, and this many from one
  // peer address, handshakes included; more are closed as soon as they are accepted. Each
  // connection that is up holds a queue pair; an engine opens one per device pair to a peer.
  std::uint32_t max_connections = 1024;
  std::uint32_t max_connections_per_peer = 256;
  // Setup connections still in the handshake have a budget of their own (they hold no queue
  // pair), so a flood of them never keeps out a client that proves the token: when it is
  // full, the oldest handshake in progress is dropped for the newcomer.
  std::uint32_t max_unproven_connections = 64;
  // Work requests in flight per connection; more wait in a queue inside the transport.
  std::uint32_t send_queue_depth = 256;
  // RDMA READs in flight per connection (bounded by the device's max_qp_rd_atom).
  std::uint32_t max_rd_atomic = 16;
  // A dead peer fails requests after about 4.096 us x 2^retry_timeout x retry_count (default
  // ~0.5 s); closing the setup connection fails them at once.
  std::uint32_t retry_timeout = 14;
  std::uint32_t retry_count = 7;
  // Revocable keys for regions registered Access::kLeased: each lease binds a type-2 memory
  // window per range, and the region's own key grants nothing remote. Used where the device
  // has type-2 windows; false (or a device without them) exposes such regions whole through
  // their key, and the store's generation fencing is the guard.
  bool memory_windows = true;
  // Registers MemoryKind::kCuda regions with ibv_reg_mr on their address where neither
  // dma-buf nor nvidia-peermem can (as nvidia-peermem would): only for device memory mapped
  // into this process, the tests' device stand-in (tests/gpu/device_standin.h). Off, GPU memory
  // the driver cannot export is refused, and the KV-cache layer stages it.
  bool device_memory_by_address = false;
  // Register host memory with on-demand paging (not pinned; the NIC faults pages in). Where
  // the device cannot do ODP for RC READ and WRITE, registration fails with kUnsupported.
  bool on_demand_paging = false;
};

struct EngineOptions {
  // Transports to start, in no particular order; empty: every one built in that starts here.
  std::vector<TransportKind> transports;
  // Force one transport for every peer (when both sides have it) instead of the automatic
  // choice: shm on the same host, then RDMA-capable verbs/UCX, then tcp, then UCX over TCP.
  std::optional<TransportKind> prefer;
  // Deadline for connect() and import_key() when the caller gives none.
  std::chrono::milliseconds control_timeout{5000};
  // Shared cluster secret. When set, both sides of every tcp connection and every verbs
  // queue-pair setup prove they know it (HMAC-SHA256 challenge-response; the token itself
  // never crosses the wire). UCX cannot prove it, so UCX does not start while one is set.
  // shm needs none: its peers are processes of this user on this host. Empty: none; any
  // other value must be at least 16 bytes and not blank (Engine::create: kInvalidArgument).
  std::string cluster_token;
  // Latency mode for small transfers, for hosts with a core to spare: a caller waiting for a
  // batch (Batch::wait) spins this long before it sleeps, and tcp's I/O threads spin this
  // long after their last event before they sleep in the kernel, so a response finds a
  // running thread instead of waking one. Costs a core per spinning thread while transfers
  // come closer together than this (never while idle); measured in docs/benchmarks.md.
  // 0 (the default): threads sleep as soon as they have nothing to do.
  std::chrono::microseconds busy_poll{0};
  TcpOptions tcp;
  ShmOptions shm;
  UcxOptions ucx;
  VerbsOptions verbs;
};

}  // namespace kvstash
