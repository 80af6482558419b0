#include "node/tier.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <optional>
#include <span>
#include <unordered_set>
#include <vector>

#include "common/checksum.h"
#include "common/log.h"
#include "common/system.h"
#include "kvstash/memory.h"
#include "metadata/tier_catalog.h"
#include "node/tier_headers.h"

namespace kvstash::node {

using namespace std::chrono_literals;
using metadata::PageRun;
using metadata::TierCatalog;

// Promotions queued together that run as one device job: at most this many, and no more once
// they read this much.
constexpr std::size_t kPromotionBatch = 16;
constexpr std::uint64_t kPromotionBytes = 16u << 20;
// The largest device I/O the tier submits.
constexpr std::uint64_t kMaxIo = 1u << 20;

struct NodeTier::AtomicCounters {
  std::atomic<std::uint64_t> written_down{0}, written_down_bytes{0}, write_down_failures{0};
  std::atomic<std::uint64_t> promoted{0}, promoted_bytes{0}, promotion_failures{0}, promotion_corrupt{0};
  std::atomic<std::uint64_t> recovered{0}, recovery_bad{0};
};

namespace {

// One I/O per stretch where a run of pool pages and a run of slots overlap, in object order:
// `pages` and `slots` hold the same number of pages.
std::vector<SsdIo> ios_for(bool write, std::span<const PageRun> pages, std::span<const PageRun> slots,
                           std::byte* pool, std::uint64_t page_size, std::uint64_t slot_base) {
  std::vector<SsdIo> out;
  std::size_t pi = 0, si = 0;
  std::uint64_t pdone = 0, sdone = 0;
  while (pi < pages.size() && si < slots.size()) {
    const std::uint64_t n = std::min(pages[pi].count - pdone, slots[si].count - sdone);
    // I/Os of at most 1 MiB (pages are multiples of 4 KiB, so of the device's blocks): many
    // in flight, as fio keeps them, and a page's parts read in parallel.
    const std::uint64_t offset = slot_base + (slots[si].first + sdone) * page_size;
    std::byte* buffer = pool + (pages[pi].first + pdone) * page_size;
    for (std::uint64_t at = 0; at < n * page_size; at += kMaxIo) {
      out.push_back({.write = write,
                     .offset = offset + at,
                     .buffer = buffer + at,
                     .length = static_cast<std::size_t>(std::min(kMaxIo, n * page_size - at))});
    }
    pdone += n;
    sdone += n;
    if (pdone == pages[pi].count) ++pi, pdone = 0;
    if (sdone == slots[si].count) ++si, sdone = 0;
  }
  return out;
}

// The tier's own sum of an object: an xxh3 per page, then one over those (pages are not
// contiguous in the pool). fold_pages adds the sums of the pages at `bytes` (`n` bytes; the
// last page may be short) to `per_page`; tier_sum folds them.
void fold_pages(std::vector<std::uint64_t>& per_page, const std::byte* bytes, std::uint64_t n,
                std::uint64_t page_size) {
  for (std::uint64_t at = 0; at < n; at += page_size)
    per_page.push_back(sum::segment_sum(bytes + at, std::min(page_size, n - at)));
}

std::string tier_sum(const std::vector<std::uint64_t>& per_page) {
  return fmt::format("{:016x}", sum::segment_sum(per_page.data(), per_page.size() * sizeof(std::uint64_t)));
}

// The sum of an object's `size` bytes in pool pages `pages`.
std::string tier_sum(std::span<const PageRun> pages, const std::byte* pool, std::uint64_t page_size,
                     std::uint64_t size) {
  std::vector<std::uint64_t> per_page;
  std::uint64_t left = size;
  for (const PageRun& r : pages) {
    const std::uint64_t n = std::min(left, r.count * page_size);
    fold_pages(per_page, pool + r.first * page_size, n, page_size);
    left -= n;
  }
  return tier_sum(per_page);
}

// The superblock: block 0 of the header area (kept out of the headers' allocation):
// "KVSTIER1", the tier id, page size, slots, the node id (length, bytes), and an xxh3 of all
// of that.
constexpr std::string_view kSuperMagic = "KVSTIER1";

std::string superblock(std::uint64_t id, std::uint64_t page_size, std::uint64_t slots,
                       const std::string& node) {
  std::string b(kSuperMagic);
  auto u64 = [&](std::uint64_t v) { b.append(reinterpret_cast<const char*>(&v), 8); };
  u64(id);
  u64(page_size);
  u64(slots);
  u64(node.size());
  b += node;
  u64(sum::segment_sum(b.data(), b.size()));
  return b;
}

// The id in a superblock for this page size, slot count and node; nullopt for anything else.
std::optional<std::uint64_t> read_superblock(const std::byte* block, std::size_t size,
                                             std::uint64_t page_size, std::uint64_t slots,
                                             const std::string& node) {
  const char* p = reinterpret_cast<const char*>(block);
  if (size < kSuperMagic.size() + 40 || std::string_view(p, kSuperMagic.size()) != kSuperMagic)
    return std::nullopt;
  std::uint64_t id = 0;
  std::memcpy(&id, p + kSuperMagic.size(), 8);
  const std::string expect = superblock(id, page_size, slots, node);
  if (expect.size() > size || std::memcmp(p, expect.data(), expect.size()) != 0) return std::nullopt;
  return id;
}

bool within_pool(std::span<const PageRun> pages, std::uint64_t pool_pages) {
  return std::ranges::all_of(pages, [&](const PageRun& r) { return r.first + r.count <= pool_pages; });
}

}  // namespace

Result<std::unique_ptr<NodeTier>> NodeTier::open(const TierOptions& options, std::uint64_t page_size,
                                                 const std::string& node_id) {
  std::unique_ptr<NodeTier> t(new NodeTier());
  t->options_ = options;
  t->header_key_ = tier_header_key(options.header_secret);
  t->page_size_ = page_size;
  t->counters_ = std::make_unique<AtomicCounters>();
  KVSTASH_ASSIGN_OR_RETURN(t->device_, SsdDevice::open({.path = options.path, .capacity = options.capacity}));
  const TierLayout layout(t->device_->capacity(), page_size, t->device_->block_size());
  if (layout.slots == 0) {
    return Status::invalid_argument(
        fmt::format("the NVMe tier {} ({} bytes) holds no page of {} bytes after its "
                    "header area",
                    options.path, t->device_->capacity(), page_size));
  }
  t->slots_ = layout.slots;
  t->layout_ = layout;
  // Headers are numbered on from the clock (microseconds): a restart never numbers a header
  // below one it wrote before.
  t->sequence_ = static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                                std::chrono::system_clock::now().time_since_epoch())
                                                .count());
  // The superblock: the same tier again, or a new one.
  const std::size_t block = t->device_->block_size();
  KVSTASH_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(block));
  KVSTASH_RETURN_IF_ERROR(
      t->device_
          ->run({{.write = false, .offset = 0, .buffer = b.data(), .length = block}}, deadline_after(10s))
          .with_context("reading the NVMe tier's superblock"));
  std::optional<std::uint64_t> id = read_superblock(b.data(), block, page_size, t->slots_, node_id);
  t->found_ = t->holds_headers_ = id.has_value();
  if (!id) {
    id = sys::random_u64();
    const std::string text = superblock(*id, page_size, t->slots_, node_id);
    std::memset(b.data(), 0, block);
    std::memcpy(b.data(), text.data(), std::min(text.size(), block));
    KVSTASH_RETURN_IF_ERROR(
        t->device_
            ->run({{.write = true, .offset = 0, .buffer = b.data(), .length = block}}, deadline_after(10s))
            .with_context("writing the NVMe tier's superblock"));
    KVSTASH_RETURN_IF_ERROR(t->device_->flush());
  }
  t->tier_id_ = fmt::format("{:016x}", *id);
  if (options.fault) t->device_->set_fault(options.fault);
  return t;
}

NodeTier::~NodeTier() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

Status NodeTier::start(metadata::CellOptions cell, std::string node_id, std::byte* pool,
                       std::uint64_t pages) {
  // A BRPOP waits `poll`: the connection's commands must outlast it.
  cell.redis.command_timeout =
      std::max(cell.redis.command_timeout, options_.poll * 4 + std::chrono::seconds(1));
  KVSTASH_ASSIGN_OR_RETURN(cell_, metadata::Cell::open(cell));
  catalog_ = std::make_unique<TierCatalog>(cell_->redis(), cell_->name());
  id_ = std::move(node_id);
  pool_ = pool;
  pool_pages_ = pages;
  thread_ = std::thread([this] { loop(); });
  return {};
}

void NodeTier::set_epoch(std::string epoch) {
  std::lock_guard lock(mu_);
  epoch_ = std::move(epoch);
}

std::uint64_t NodeTier::low_water(std::uint64_t pool_pages) const {
  return std::max<std::uint64_t>(
      1, static_cast<std::uint64_t>(static_cast<double>(pool_pages) * options_.low_water + 0.5));
}

void NodeTier::pause() {
  set_epoch({});
  std::lock_guard job(job_mu_);
}

NodeTier::Counters NodeTier::counters() const {
  const auto& c = *counters_;
  return {c.written_down.load(),      c.written_down_bytes.load(), c.write_down_failures.load(),
          c.promoted.load(),          c.promoted_bytes.load(),     c.promotion_failures.load(),
          c.promotion_corrupt.load(), c.recovered.load(),          c.recovery_bad.load()};
}

Deadline NodeTier::job_deadline() const {
  // Well inside the cell's lease, whatever the clocks: the job ends (its I/O cancelled) first.
  return deadline_after(std::min(options_.io_timeout, options_.lease / 2));
}

void NodeTier::loop() {
  bool busy = false;  // the last write-down moved something: look again at once
  for (;;) {
    std::string epoch;
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
      epoch = epoch_;
    }
    if (epoch.empty()) {
      std::this_thread::sleep_for(options_.poll);
      continue;
    }
    // First, under each new registration: a cell that started the tier over gets back what
    // the device holds (nothing moves down before).
    if (epoch != recovered_epoch_) {
      bool over = false;
      {
        std::lock_guard job(job_mu_);
        std::unique_lock lock(mu_);
        const bool current = epoch_ == epoch;
        lock.unlock();
        over = current && recover(epoch);
      }
      if (over) {
        recovered_epoch_ = epoch;
      } else {
        std::this_thread::sleep_for(options_.poll);
      }
      continue;
    }
    // Promotions first: a get waits on each.
    auto next = catalog_->next_promotion(id_, busy ? std::chrono::milliseconds(0) : options_.poll);
    if (!next.is_ok()) {
      KVSTASH_LOG_WARN("node {}: NVMe tier: {}", id_, next.status().to_string());
      std::this_thread::sleep_for(options_.poll);
      continue;
    }
    std::lock_guard job(job_mu_);
    {
      std::lock_guard lock(mu_);
      if (epoch_ != epoch) continue;  // paused meanwhile
    }
    if (next->has_value() && !(*next)->empty()) {
      promote(epoch, **next);
      continue;
    }
    // No promotion waits (or the cell nudged: the pool went below its low water).
    busy = write_down(epoch, busy);
  }
}

bool NodeTier::write_down(const std::string& epoch, bool eager) {
  // Below the low water, objects move until twice as many pages are free: batches large
  // enough to keep the device busy, not one page per look. While puts keep the pool short
  // (the last batch moved something), the next batch starts at once below that high water,
  // so the device does not wait for the pool to sink to its low water again.
  const std::uint64_t low = low_water(pool_pages_), high = std::min(pool_pages_, 2 * low);
  auto batch =
      catalog_->begin_write_down(id_, epoch, eager ? high : low, high, options_.batch_pages, options_.lease);
  if (!batch.is_ok()) {
    if (batch.status().code() != StatusCode::kStale) {
      KVSTASH_LOG_WARN("node {}: NVMe tier: write-down: {}", id_, batch.status().to_string());
    }
    return false;
  }
  if (batch->objects.empty()) return false;
  for (const auto& w : batch->objects) {
    if (!within_pool(w.pages, pool_pages_) || w.slots.back().first + w.slots.back().count > slots_) {
      (void)catalog_->abort_write_down(id_, batch->objects);
      KVSTASH_LOG_ERROR("node {}: NVMe tier: the cell named pages or slots out of range for {}", id_, w.key);
      return false;
    }
  }
  // The bytes go to the device while this thread sums them (both only read the pool pages):
  // the sums cost no device time. The bytes written are these, unless a put replaced the
  // object meanwhile, and then its commit fails on the token.
  std::vector<SsdIo> ios;
  for (const auto& w : batch->objects) {
    auto more = ios_for(true, w.pages, w.slots, pool_, page_size_, layout_.slot_offset(0));
    ios.insert(ios.end(), more.begin(), more.end());
  }
  auto done = std::make_shared<std::promise<Status>>();
  std::future<Status> data = done->get_future();
  device_->submit(std::move(ios), job_deadline(), [done](Status s) { done->set_value(std::move(s)); });
  std::vector<std::string> sums;
  for (const auto& w : batch->objects) sums.push_back(tier_sum(w.pages, pool_, page_size_, w.size));
  // Then each object's header place (its first slot's): its header, or zeros (an older header
  // there names slots this object now holds). After its bytes, before the flush.
  const std::uint64_t unit = layout_.header_unit;
  auto headers = Buffer::allocate(batch->objects.size() * unit);
  Status wrote = data.get();
  if (wrote.is_ok()) wrote = headers.status();
  if (wrote.is_ok()) {
    std::memset(headers->data(), 0, headers->size());
    std::vector<SsdIo> places;
    for (std::size_t i = 0; i < batch->objects.size(); ++i) {
      const auto& w = batch->objects[i];
      std::byte* place = headers->data() + i * unit;
      if (recoverable(w.key)) {
        TierHeader h{.sequence = ++sequence_,
                     .cell = cell_->name(),
                     .key = w.key,
                     .token = w.token,
                     .size = w.size,
                     .checksum = w.checksum,
                     .layout = w.layout,
                     .sum = sums[i],
                     .expires_ms = w.expires_ms};
        for (const PageRun& r : w.slots) h.runs.emplace_back(r.first, r.count);
        // One that does not fit its place (a layout of kilobytes) is not recoverable.
        if (auto bytes = encode_tier_header(h, unit, header_key_); bytes.is_ok()) {
          std::memcpy(place, bytes->data(), bytes->size());
          holds_headers_ = true;
        }
      }
      places.push_back({.write = true,
                        .offset = layout_.header_offset(w.slots.front().first),
                        .buffer = place,
                        .length = static_cast<std::size_t>(unit)});
    }
    wrote = device_->run(std::move(places), job_deadline());
  }
  if (!wrote.is_ok()) {
    counters_->write_down_failures += batch->objects.size();
    KVSTASH_LOG_WARN("node {}: NVMe tier: a write-down of {} objects failed ({}); they stay in the pool", id_,
                     batch->objects.size(), wrote.to_string());
    (void)catalog_->abort_write_down(id_, batch->objects);
    return false;
  }
  // On the device before the cell says so: a power loss after the commit must not find the
  // slots' bytes (or a file's extents) still in a cache.
  if (Status flushed = device_->flush(); !flushed.is_ok()) {
    counters_->write_down_failures += batch->objects.size();
    KVSTASH_LOG_WARN("node {}: NVMe tier: flushing a write-down failed ({}); its objects stay in the pool",
                     id_, flushed.to_string());
    (void)catalog_->abort_write_down(id_, batch->objects);
    return false;
  }
  std::vector<TierCatalog::Written> written;
  for (std::size_t i = 0; i < batch->objects.size(); ++i) {
    const auto& w = batch->objects[i];
    written.push_back({w.key, w.token, w.slots_text, sums[i]});
  }
  auto committed = catalog_->commit_write_down(id_, epoch, written);
  if (!committed.is_ok()) {
    // The slots stay marked until their deadline; the next write-down of the object frees them.
    KVSTASH_LOG_WARN("node {}: NVMe tier: commit of a write-down: {}", id_, committed.status().to_string());
    return false;
  }
  std::uint64_t moved = 0;
  for (std::size_t i = 0; i < committed->size(); ++i) {
    if ((*committed)[i].is_ok()) {
      ++moved;
      counters_->written_down_bytes += batch->objects[i].size;
    } else {
      ++counters_->write_down_failures;
    }
  }
  counters_->written_down += moved;
  return moved > 0;
}

// A device job of promotions: their leases, their reads, and the reads' outcome once done.
struct NodeTier::PromotionJob {
  std::vector<TierCatalog::Promotion> promotions;
  std::vector<SsdIo> ios;
  std::uint64_t bytes = 0;
  std::future<Status> read;
};

std::unique_ptr<NodeTier::PromotionJob> NodeTier::stage_job(const std::string& epoch,
                                                            std::optional<std::string> first) {
  auto job = std::make_unique<PromotionJob>();
  // Stages `key`: its pool pages leased, its reads added to the job's.
  auto stage = [&](const std::string& key) {
    const std::string put_token = fmt::format("promote-{}-{:016x}", id_, sys::random_u64());
    auto begun = catalog_->begin_promote(id_, epoch, key, put_token, options_.lease, false);
    if (begun.status().code() == StatusCode::kNoSpace) {
      // The pool is full: move its coldest objects down first, and evict only what that could
      // not make room for.
      write_down(epoch, true);
      begun = catalog_->begin_promote(id_, epoch, key, put_token, options_.lease, true);
    }
    if (!begun.is_ok()) {
      ++counters_->promotion_failures;
      // No room (every page leased) or the node re-registering: its gets ask again.
      KVSTASH_LOG_DEBUG("node {}: NVMe tier: promotion of {}: {}", id_, key, begun.status().to_string());
      return;
    }
    if (!begun->has_value()) return;  // promoted already, or gone
    TierCatalog::Promotion& p = **begun;
    if (!within_pool(p.pages, pool_pages_) || p.slots.back().first + p.slots.back().count > slots_) {
      ++counters_->promotion_failures;
      (void)catalog_->abort_promote(id_, p, false);
      KVSTASH_LOG_ERROR("node {}: NVMe tier: the cell named pages or slots out of range for {}", id_, key);
      return;
    }
    // From here until the device gives the buffers back, this thread writes into the lease's
    // pages.
    writing_until_ = std::min(writing_until_.load(), p.deadline_ms);
    auto more = ios_for(false, p.pages, p.slots, pool_, page_size_, layout_.slot_offset(0));
    job->ios.insert(job->ios.end(), more.begin(), more.end());
    job->bytes += p.size;
    job->promotions.push_back(std::move(p));
  };
  // Promotions queued meanwhile join this job while it reads less than kPromotionBytes (their
  // reads in flight together: small objects fill the device's queue); a large one runs alone.
  if (first) stage(*first);
  while (job->bytes < kPromotionBytes && job->promotions.size() < kPromotionBatch) {
    auto more = catalog_->next_promotion(id_, std::chrono::milliseconds(0));
    if (!more.is_ok() || !more->has_value()) break;
    if (!(*more)->empty()) stage(**more);  // empty: a nudge; the write-down runs after the jobs
  }
  if (job->promotions.empty()) return nullptr;
  auto done = std::make_shared<std::promise<Status>>();
  job->read = done->get_future();
  device_->submit(job->ios, job_deadline(), [done](Status s) { done->set_value(std::move(s)); });
  return job;
}

void NodeTier::finish_job(const std::string& epoch, PromotionJob& job) {
  const Status read = job.read.get();  // the buffers are this thread's again
  for (const TierCatalog::Promotion& p : job.promotions) {
    Status failed = read;
    bool bad = !read.is_ok() && read.code() != StatusCode::kTimeout;
    if (read.is_ok() && tier_sum(p.pages, pool_, page_size_, p.size) != p.sum) {
      ++counters_->promotion_corrupt;
      failed = Status::corrupt(fmt::format("the bytes of {} on the NVMe tier do not match their sum", p.key));
      bad = true;
    }
    // One batch: a device error fails each of its promotions (which one it hit, the batch does
    // not say), and drops each object as lost.
    bool dropped = false;
    Status done;
    if (failed.is_ok()) {
      done = catalog_->commit_promote(id_, epoch, p);
    } else {
      auto aborted = catalog_->abort_promote(id_, p, bad);
      dropped = aborted.is_ok() && *aborted;
      done = aborted.status();
    }
    if (failed.is_ok() && done.is_ok()) {
      ++counters_->promoted;
      counters_->promoted_bytes += p.size;
      continue;
    }
    ++counters_->promotion_failures;
    const Status& why = failed.is_ok() ? done : failed;
    if (why.code() == StatusCode::kStale || (bad && !dropped && done.is_ok())) {
      // Replaced or removed meanwhile (its slots reused, so its bytes no longer matched):
      // routine under churn, nothing dropped (its gets ask again).
      KVSTASH_LOG_DEBUG("node {}: NVMe tier: promotion of {}: {}", id_, p.key, why.to_string());
    } else {
      KVSTASH_LOG_WARN("node {}: NVMe tier: promotion of {} failed: {}{}", id_, p.key, why.to_string(),
                       dropped ? " (the object is dropped)" : "");
    }
  }
}

void NodeTier::promote(const std::string& epoch, std::string first) {
  // Two jobs at a time: the next one's reads are in flight while this one's bytes are checked
  // and committed (and its gets read them), so the device does not wait for the scripts.
  std::unique_ptr<PromotionJob> running = stage_job(epoch, std::move(first));
  while (running) {
    std::unique_ptr<PromotionJob> next = stage_job(epoch, std::nullopt);
    finish_job(epoch, *running);
    running = std::move(next);
  }
  writing_until_ = std::numeric_limits<std::int64_t>::max();
}

bool NodeTier::recoverable(std::string_view key) const {
  return std::ranges::any_of(options_.recover_prefixes,
                             [&](const std::string& p) { return key.starts_with(p); });
}

void NodeTier::promote_queued(const std::string& epoch) {
  auto next = catalog_->next_promotion(id_, std::chrono::milliseconds(0));
  if (next.is_ok() && next->has_value() && !(*next)->empty()) promote(epoch, **next);
}

bool NodeTier::recover(const std::string& epoch) {
  auto begun = catalog_->begin_recovery(id_, epoch);
  if (!begun.is_ok()) {
    KVSTASH_LOG_WARN("node {}: NVMe tier: recovery: {}", id_, begun.status().to_string());
    return false;
  }
  if (!*begun) return true;
  TierCatalog::RecoveryCounts counts;
  std::vector<bool> claimed(slots_, false);
  auto claimed_runs = [&] {
    std::string out;
    for (std::uint64_t s = 0; s < slots_;) {
      if (!claimed[s]) {
        ++s;
        continue;
      }
      std::uint64_t e = s;
      while (e < slots_ && claimed[e]) ++e;
      out += fmt::format("{}{},{}", out.empty() ? "" : ";", s, e - s);
      s = e;
    }
    return out;
  };
  auto finish = [&] {
    const Status ended = catalog_->end_recovery(id_, epoch, counts, claimed_runs());
    if (!ended.is_ok()) KVSTASH_LOG_WARN("node {}: NVMe tier: recovery: {}", id_, ended.to_string());
    return ended.is_ok();
  };
  // A device laid out afresh at open, that this process has written no header to since,
  // holds nothing of the cell's; without recoverable keys nothing is offered.
  if (!holds_headers_ || options_.recover_prefixes.empty()) return finish();
  const auto started = std::chrono::steady_clock::now();
  auto scanned = scan_tier_headers(*device_, layout_, deadline_after(std::chrono::minutes(10)), header_key_);
  if (!scanned.is_ok()) {
    KVSTASH_LOG_WARN("node {}: NVMe tier: recovery: reading the headers failed ({}); nothing is recovered",
                     id_, scanned.status().to_string());
    return finish();
  }
  // What a header must say to be offered: this cell, a recoverable key, its slots on this
  // tier starting at its place, as many as its size takes.
  std::vector<std::pair<TierHeader, std::uint64_t>> found;
  for (auto& [h, slot] : *scanned) {
    sequence_ = std::max(sequence_, h.sequence);
    std::uint64_t pages = 0;
    bool in_range = !h.runs.empty() && h.runs.front().first == slot;
    for (auto [first, count] : h.runs) {
      in_range = in_range && count > 0 && first < slots_ && count <= slots_ - first;
      pages += count;
    }
    if (h.cell != cell_->name() || !recoverable(h.key) || !in_range || h.size == 0 || h.sum.empty() ||
        pages != (h.size + page_size_ - 1) / page_size_) {
      continue;
    }
    found.emplace_back(std::move(h), slot);
  }
  // Of two that share a slot, the newer (the older's bytes there are overwritten); of two of
  // one key, the newer (either is one of the key's puts; the newer is what the cell last had).
  std::ranges::sort(found, [](const auto& a, const auto& b) { return a.first.sequence > b.first.sequence; });
  std::unordered_set<std::string> keys;
  std::erase_if(found, [&](const auto& f) {
    if (!keys.insert(f.first.key).second) return true;
    for (auto [first, count] : f.first.runs) {
      for (std::uint64_t i = first; i < first + count; ++i) {
        if (claimed[i]) return true;
      }
    }
    for (auto [first, count] : f.first.runs)
      std::fill_n(claimed.begin() + static_cast<std::ptrdiff_t>(first), count, true);
    return false;
  });
  std::ranges::sort(found, {}, [](const auto& f) { return f.second; });  // read in device order
  counts.found = found.size();
  KVSTASH_LOG_INFO(
      "node {}: NVMe tier: the cell started the tier over; checking {} objects' bytes to offer them", id_,
      found.size());
  auto unclaim = [&](const TierHeader& h) {
    for (auto [first, count] : h.runs)
      std::fill_n(claimed.begin() + static_cast<std::ptrdiff_t>(first), count, false);
  };
  const std::uint64_t chunk_pages = std::max<std::uint64_t>(1, kPromotionBytes / page_size_);
  auto buffer = Buffer::allocate(chunk_pages * page_size_);
  if (!buffer.is_ok()) return false;
  // Checks `h`'s bytes against its sum, a chunk of its slots at a time.
  auto verify = [&](const TierHeader& h) -> Result<bool> {
    std::vector<std::uint64_t> per_page;
    std::uint64_t left = h.size;
    for (auto [first, count] : h.runs) {
      for (std::uint64_t at = 0; at < count; at += chunk_pages) {
        const std::uint64_t n = std::min(chunk_pages, count - at);
        const PageRun slots{first + at, n}, pages{0, n};
        KVSTASH_RETURN_IF_ERROR(device_->run(
            ios_for(false, {&pages, 1}, {&slots, 1}, buffer->data(), page_size_, layout_.slot_offset(0)),
            job_deadline()));
        const std::uint64_t bytes = std::min(left, n * page_size_);
        fold_pages(per_page, buffer->data(), bytes, page_size_);
        left -= bytes;
      }
    }
    return tier_sum(per_page) == h.sum;
  };
  constexpr std::size_t kOffer = 32;
  std::vector<TierCatalog::Recovered> offer;
  std::vector<const TierHeader*> offered;
  auto send = [&]() -> bool {
    auto answers = catalog_->offer_recovered(id_, epoch, counts, offer);
    if (!answers.is_ok()) {
      KVSTASH_LOG_WARN("node {}: NVMe tier: recovery: {}", id_, answers.status().to_string());
      return false;
    }
    for (std::size_t i = 0; i < answers->size(); ++i) {
      const auto a = (*answers)[i];
      if (a == TierCatalog::Offered::kAdmitted) ++counters_->recovered;
      if (a != TierCatalog::Offered::kAdmitted && a != TierCatalog::Offered::kKept) unclaim(*offered[i]);
    }
    offer.clear();
    offered.clear();
    return true;
  };
  for (const auto& [h, slot] : found) {
    {
      std::lock_guard lock(mu_);
      if (epoch_ != epoch || stopping_) return false;  // registering again: it runs again then
    }
    auto ok = verify(h);
    ++counts.checked;
    if (!ok.is_ok() || !*ok) {
      ++counts.bad;
      ++counters_->recovery_bad;
      unclaim(h);
      if (!ok.is_ok()) {
        KVSTASH_LOG_WARN("node {}: NVMe tier: recovery: reading {} failed: {}", id_, h.key,
                         ok.status().to_string());
      }
      continue;
    }
    std::string runs;
    for (auto [first, count] : h.runs) runs += fmt::format("{}{},{}", runs.empty() ? "" : ";", first, count);
    offer.push_back({.key = h.key,
                     .token = h.token,
                     .checksum = h.checksum,
                     .layout = h.layout,
                     .runs = std::move(runs),
                     .sum = h.sum,
                     .size = h.size,
                     .expires_ms = h.expires_ms});
    offered.push_back(&h);
    if (offer.size() == kOffer) {
      if (!send()) return false;
      promote_queued(epoch);  // what is admitted is readable now: its gets need not wait
    }
  }
  if (!offer.empty() && !send()) return false;
  if (!finish()) return false;
  KVSTASH_LOG_INFO(
      "node {}: NVMe tier: recovery done in {} ms: {} objects checked, {} did not match their sum, "
      "{} admitted",
      id_,
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started)
          .count(),
      counts.checked, counts.bad, counters_->recovered.load());
  return true;
}

}  // namespace kvstash::node
