// kvstash/kvpeer.h: a KV cache's blocks read straight out of another process's cache, with no
// memory node in between: prefill/decode disaggregation's direct path (docs/integration.md).
//
// The process that holds the blocks (the prefill) opens a KvExport over its cache's layout.
// Its regions are registered for leased access only (Access::kLeased): a peer reaches them
// through leases alone, which name the blocks, end at a deadline by the exporter's clock, and
// carry a fence tag. descriptor() is what a reader needs (the engine's address, each region's
// key, the layout); the exporter hands it over out of band (the cell's Redis: KvHandoffs).
//
// A reader (the decode) opens a KvImport over its own cache of the same shape and reads blocks
// of an export into its own blocks, every layer, one-sided: RDMA READ (GPU to GPU where the NIC
// reaches both), tcp, or shm between processes of one host. Once the exporter has fenced
// through a read's tag (KvExport::fence), no op of that read can touch its memory any more,
// so it may hand the blocks to other requests: a stalled or vanished reader never holds them.
//
//   auto out = KvExport::open(prefill_store, prefill_layout).value();
//   publish(out->descriptor(), blocks, deadline_ms,            // the reader's fence tag
//           out->grant(blocks, deadline_ms).value());          // and what it may read
//   ...
//   auto in = KvImport::open(decode_store, decode_layout).value();
//   auto read = in->begin_read(descriptor, remote_blocks, local_blocks,
//                              {.fence = deadline_ms, .ttl = 30s, .grant = grant}, deadline).value();
//   Status s = read.wait();       // OK: every byte of every layer landed
//   ...                           // the exporter, past deadline_ms: out->fence(deadline_ms)
//
// Thread safety: KvExport and KvImport are safe to use from several threads; a KvPeerRead is
// one caller's handle.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash {

class Store;
class KvLayout;

// A cache's memory, readable by peers under leases.
class KvExport {
 public:
  // Registers every region of `layout` with `store`'s engine for leased access (the engine's
  // transports that can serve it: tcp and shm host memory, verbs host and GPU memory).
  // Errors: registration errors (kUnsupported when no transport can serve the memory).
  static Result<std::unique_ptr<KvExport>> open(Store& store, const KvLayout& layout);
  ~KvExport();

  // Where the cache is, for a KvImport: text, a few hundred bytes per region.
  const std::string& descriptor() const;
  // Ends every lease whose fence tag is <= `through`: returns once no read under them can
  // touch the cache (shm: a copy that began before may still be finishing; see Engine::fence).
  void fence(std::uint64_t through);

  // What a reader of `blocks` (every layer and part) needs, until this export fences through
  // `fence` (KvPeerReadOptions::grant): tcp and verbs serve a read of this cache only under
  // such a grant, and only over its blocks. Text; hand it over with the blocks (the handoff
  // record). shm peers of this host and user map the regions themselves (docs/operations.md,
  // "Threat model"). Errors: kInvalidArgument (no blocks, one out of range, fence 0).
  Result<std::string> grant(std::span<const std::uint32_t> blocks, std::uint64_t fence) const;

 private:
  struct Impl;
  explicit KvExport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One read of a peer's blocks. Destroying an unfinished read cancels it and waits until no op
// of it can touch either side's memory.
class KvPeerRead {
 public:
  KvPeerRead();
  KvPeerRead(KvPeerRead&&) noexcept;
  KvPeerRead& operator=(KvPeerRead&&) noexcept;
  ~KvPeerRead();

  // True once every byte moved or the read failed. Never blocks.
  bool poll();
  // Blocks until done or the read's deadline (kTimeout). OK only when every layer of every
  // block landed: anything else leaves the local blocks partly written.
  Status wait();
  void cancel();
  std::uint64_t bytes() const;  // what the read moves

 private:
  friend class KvImport;
  struct State;
  std::unique_ptr<State> state_;
};

struct KvPeerReadOptions {
  // The lease's fence tag: the exporter ends the read by fencing through it.
  std::uint64_t fence = 0;
  // The lease's life by the exporter's clock (at most 10 minutes).
  std::chrono::milliseconds ttl{30000};
  // The exporter's grant for the blocks read (KvExport::grant, with this fence).
  std::string grant;
  // Tensor parallelism across degrees: heads [remote_head_first, + heads) of the peer's blocks
  // land in heads [local_head_first, + heads) of this cache's, the rest of each block is left
  // as it is. 0 heads: every head, both caches of one shape.
  std::uint32_t heads = 0;
  std::uint32_t remote_head_first = 0;
  std::uint32_t local_head_first = 0;
};

// A cache that reads blocks out of peers' exports.
class KvImport {
 public:
  // Registers `layout`'s regions with `store`'s engine for this process's own transfers.
  static Result<std::unique_ptr<KvImport>> open(Store& store, const KvLayout& layout);
  ~KvImport();

  // Reads `remote_blocks` of the export `descriptor` into `local_blocks` (the same count; block
  // i into block i), every layer and part, or with options.heads those heads only (the peer's
  // blocks may then hold another number of heads). The peer's connection and keys are kept for
  // later reads. Errors before anything moves: kInvalidArgument (a malformed descriptor, another
  // shape than this cache's or heads out of either's range, a block out of range, counts that
  // differ), the peer's errors
  // (kUnavailable, kPermissionDenied, kUnsupported: no transport in common that leases),
  // kStale (the exporter fenced the tag already), kTimeout at `deadline`.
  Result<KvPeerRead> begin_read(std::string_view descriptor, std::span<const std::uint32_t> remote_blocks,
                                std::span<const std::uint32_t> local_blocks, const KvPeerReadOptions& options,
                                Deadline deadline);

 private:
  struct Impl;
  explicit KvImport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Handoffs: the direct path's rendezvous. A short-lived record in the cell's Redis saying where
// a process holds memory for `readers` (a KvExport's descriptor and the blocks) and which of
// them have yet to read it. Only metadata: the bytes move one-sided. It lives in the cell a put
// of its name would go to (the holder and its readers, opened on the same cells, find the same
// one), expires after `ttl` (> 0) by Redis's clock, and goes with its last reader's end().
// Names and readers: 1..256 printable bytes, no spaces. Publishing a name again replaces its
// record. Every call is one Redis script, with the store's deadline (its timeout by default).
class KvHandoffs {
 public:
  explicit KvHandoffs(Store& store) : store_(&store) {}

  Status publish(std::string_view name, std::string_view descriptor, std::span<const std::string> readers,
                 std::chrono::milliseconds ttl, std::optional<Deadline> deadline = {});
  // The descriptor. kNotFound once the record expired or went with its last reader.
  Result<std::string> descriptor(std::string_view name, std::optional<Deadline> deadline = {});
  // `reader` is done with the memory: true when it was pending, false when it had ended
  // already or the record expired.
  Result<bool> end(std::string_view name, std::string_view reader, std::optional<Deadline> deadline = {});
  // Whether `reader` has yet to end it (false once it did, or the record expired): what the
  // holder polls before it gives the memory up.
  Result<bool> pending(std::string_view name, std::string_view reader, std::optional<Deadline> deadline = {});

 private:
  Store* store_;
};

}  // namespace kvstash
