// NodeTier: a memory node's NVMe tier (docs/nvme-tier.md). A thread of its own, with a Redis
// connection of its own, moves the pool's cold objects down to the device before the pool runs
// out (write-down: instead of their eviction), and stages them back into pool pages when a
// get asks for one (promotion). The cell decides what moves and hands out slots as it hands
// out pages (metadata/tier_catalog.h); this moves the bytes, with a sum of its own over them
// (checked on every promotion, whatever the clients' checksum setting).
//
// Slots are written only by this thread's write-downs, each of which waits for its device I/O
// to end (SsdDevice::run gives its buffers back) before it commits or gives its slots back, so
// a slot the cell frees is never still being written. Promotions only read slots (two device
// jobs of them in flight at most); a slot freed and written again while a promotion reads it
// (its object removed meanwhile) gives bytes that fail the sum, and the commit would fail on
// the object's token anyway. A promotion writes into pool pages under a put lease of the cell:
// while it runs, writing_until() holds the node's reported fence below that lease's deadline,
// so the cell frees those pages only once the device is done with them.
//
// Thread safety: set_epoch, writing_until and counters from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kvstash/status.h"
#include "metadata/cell.h"
#include "node/ssd_device.h"
#include "node/tier_headers.h"

namespace kvstash::metadata {
class TierCatalog;
}

namespace kvstash::node {

struct TierOptions {
  // The device: a file (created with the capacity) or a block device (SsdOptions).
  std::string path;
  std::uint64_t capacity = 0;
  // Objects move down while fewer than this share of the pool's pages are free.
  double low_water = 0.125;
  // The most pages one write-down moves (one script, one device batch).
  std::uint32_t batch_pages = 64;
  // A write-down's and a promotion's lease in the cell; the device's deadline for one job.
  std::chrono::milliseconds lease{10000};
  std::chrono::milliseconds io_timeout{5000};
  // How long the thread waits for a promotion before it looks at the pool's free pages again.
  std::chrono::milliseconds poll{20};
  // Key prefixes whose keys name their content (a KV cache's chunk keys: "kvp:"): their
  // objects get a header on the device, and a cell that lost its Redis gets them back from it
  // (docs/metadata.md, "A cell that lost its Redis"). Empty: none.
  std::vector<std::string> recover_prefixes;
  // The node's secret (its cluster token): the headers are signed with a key made from it, and
  // a recovery admits only headers it signed. Empty: unkeyed headers (anyone who can write the
  // device can forge them).
  std::string header_secret;
  // Fault injection (SsdDevice::set_fault): the history checker's and the tests' failing device.
  std::function<int(const SsdIo&)> fault;
};

class NodeTier {
 public:
  // Opens the device and lays it out for pages of `page_size`, for node `node_id`. Its
  // superblock (the header area's first block) names the tier: the same tier found again (the
  // same node, page size and slots) keeps its id, and with it, in the cell, its objects; any
  // other device gets a new id, and the cell starts its tier over. Errors: SsdDevice::open's;
  // kInvalidArgument when it holds no slot.
  static Result<std::unique_ptr<NodeTier>> open(const TierOptions& options, std::uint64_t page_size,
                                                const std::string& node_id);
  ~NodeTier();  // stops the thread
  NodeTier(const NodeTier&) = delete;
  NodeTier& operator=(const NodeTier&) = delete;

  std::uint64_t slots() const { return slots_; }
  // The tier's identity (16 hex digits), from its superblock; whether open() found it there.
  const std::string& id() const { return tier_id_; }
  bool found() const { return found_; }
  // Pages of a pool of `pool_pages`: objects move down while fewer are free (at least 1).
  std::uint64_t low_water(std::uint64_t pool_pages) const;
  const SsdDevice& device() const { return *device_; }

  // Starts the thread over the node's pool (`pages` pages at `pool`), connecting to the cell
  // with `cell` (its command timeout is raised above the promotion wait).
  Status start(metadata::CellOptions cell, std::string node_id, std::byte* pool, std::uint64_t pages);
  // The node's registration: jobs run under it.
  void set_epoch(std::string epoch);
  // No job runs under any epoch until the next set_epoch, and the one running has ended (its
  // device I/O too): the node is about to register again, and its pool to start over.
  void pause();
  // Redis time (ms) up to which this thread may still write into pool pages of a promotion's
  // lease; the maximum when none runs. The node reports no fence at or past it.
  std::int64_t writing_until() const { return writing_until_.load(); }

  struct Counters {
    std::uint64_t written_down = 0, written_down_bytes = 0, write_down_failures = 0;
    std::uint64_t promoted = 0, promoted_bytes = 0, promotion_failures = 0, promotion_corrupt = 0;
    // Recoveries into a cell that started the tier over: objects it admitted, and headers
    // whose bytes no longer matched their sum.
    std::uint64_t recovered = 0, recovery_bad = 0;
  };
  Counters counters() const;

 private:
  NodeTier() = default;
  void loop();
  // Offers what the device holds of the recoverable keys to a cell that started this tier over
  // (TierCatalog::begin_recovery says whether it did). Returns whether the recovery is over
  // (ran, or none was wanted); false to try again (Redis or the epoch changed meanwhile).
  bool recover(const std::string& epoch);
  bool recoverable(std::string_view key) const;
  // Runs the promotions gets have queued, if any, without waiting for one.
  void promote_queued(const std::string& epoch);
  // One write-down batch, while fewer pages than the low water are free (`eager`: than the
  // high water); returns whether it moved anything (then the next one runs at once, eager).
  bool write_down(const std::string& epoch, bool eager);
  // Promotes `first` (queued by a get), and whatever else is queued meanwhile, in device jobs
  // of up to 16 MiB, the next one's reads in flight while the last one is checked and
  // committed.
  void promote(const std::string& epoch, std::string first);
  struct PromotionJob;
  // Leases pages for `first` and what else is queued, up to a job's size, and starts their
  // reads; null when none could be staged.
  std::unique_ptr<PromotionJob> stage_job(const std::string& epoch, std::optional<std::string> first);
  // Waits for the job's reads, checks each object's bytes against its sum, and commits (or
  // aborts) each promotion.
  void finish_job(const std::string& epoch, PromotionJob& job);
  Deadline job_deadline() const;

  TierOptions options_;
  std::uint64_t page_size_ = 0;
  std::uint64_t slots_ = 0;
  TierLayout layout_{0, 0, 4096};
  std::uint64_t sequence_ = 0;            // the last header's (TierHeader::sequence)
  std::vector<std::uint8_t> header_key_;  // tier_header_key(options_.header_secret)
  std::string recovered_epoch_;           // the registration whose recovery is over
  std::string tier_id_;
  bool found_ = false;
  bool holds_headers_ = false;  // found_, or a header written since: a recovery reads them
  std::unique_ptr<SsdDevice> device_;
  std::unique_ptr<metadata::Cell> cell_;
  std::unique_ptr<metadata::TierCatalog> catalog_;  // over cell_: this thread's only
  std::string id_;
  std::byte* pool_ = nullptr;
  std::uint64_t pool_pages_ = 0;

  std::mutex job_mu_;  // held by the thread through each job
  mutable std::mutex mu_;
  std::string epoch_;
  bool stopping_ = false;
  std::thread thread_;
  std::atomic<std::int64_t> writing_until_{std::numeric_limits<std::int64_t>::max()};
  struct AtomicCounters;
  std::unique_ptr<AtomicCounters> counters_;
};

}  // namespace kvstash::node
