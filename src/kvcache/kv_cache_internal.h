// Private to src/kvcache: the state KvCache, KvSave and KvLoad share. KvCache::Impl is a
// cache's (its layout, keys, data path, bounce pools and threads; kv_cache.cc opens it),
// KvSave::State a save's (kv_save.cc), KvLoad::State a load's (kv_load.cc). kv_cache.cc's
// begin_save and begin_load_range fill the latter two in.
//
// Thread safety: an Impl is read-only once open() returned (its pools and the store lock
// themselves); each State says what guards it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "kvcache/bounce_pool.h"
#include "kvstash/engine.h"
#include "kvstash/kvcache.h"
#include "kvstash/status.h"
#include "kvstash/store.h"
#include "kvstash/types.h"

namespace kvstash {

namespace kvcache {

// Loads in flight at once per cache (each is one store get, its transfers already parallel).
inline constexpr unsigned kLoadThreads = 4;
// Threads submitting saves' layers (and checksumming them while the writes fly).
inline constexpr unsigned kSaveThreads = 4;

}  // namespace kvcache

// Members are destroyed bottom up: the thread pools finish their tasks before the bounce
// pools and the registrations they use go.
struct KvCache::Impl {
  Store* store = nullptr;
  KvLayout layout;
  PrefixKeyOptions keys;
  KvCacheOptions options;                             // .device: see `device`
  std::vector<MemoryHandle> handles;                  // one per layout region (direct data path)
  std::unique_ptr<kvcache::BouncePool> save_bounces;  // bounce_slots layers each (staged data path)
  std::unique_ptr<kvcache::BouncePool> load_bounces;  // one chunk each
  std::uint32_t blocks_per_chunk = 0;
  std::unique_ptr<ThreadPool> loaders = std::make_unique<ThreadPool>(kvcache::kLoadThreads);
  std::unique_ptr<ThreadPool> savers = std::make_unique<ThreadPool>(kvcache::kSaveThreads);

  // Layer `l` of a chunk's blocks, as runs of the cache's memory.
  Result<std::vector<KvRun>> layer_runs(std::uint32_t l, std::span<const std::uint32_t> blocks) const {
    std::vector<KvRun> runs;
    KVSTASH_RETURN_IF_ERROR(layout.layer_runs(l, blocks, runs));
    return runs;
  }

  // Appends `runs` to `out` as slices of the cache's registered memory (the direct data path).
  void append_slices(std::span<const KvRun> runs, std::vector<Slice>& out) const {
    for (const KvRun& r : runs)
      out.push_back({r.addr, static_cast<std::size_t>(r.length), &handles[r.region]});
  }
  std::vector<Slice> slices(const std::vector<KvRun>& runs) const {
    std::vector<Slice> out;
    out.reserve(runs.size());
    append_slices(runs, out);
    return out;
  }

  std::uint64_t chunk_bytes() const {
    return layout.layer_bytes(blocks_per_chunk) * layout.shape().num_layers;
  }
  bool staged() const { return staged_path; }
  // The cache's bytes, on the direct path, are summed by the device (the host must not read
  // them); host memory is summed by the store while its writes fly.
  bool device_sums() const { return !staged_path && device_memory; }

  std::shared_ptr<KvDevice> device;
  bool staged_path = false;
  bool device_memory = false;  // some region is not host memory

  // The blocks of chunk `c` of a request (covers() checked that there are that many).
  std::vector<std::uint32_t> chunk_blocks(std::span<const std::uint32_t> block_ids, std::size_t c) const {
    const auto first = block_ids.begin() + static_cast<std::ptrdiff_t>(c * blocks_per_chunk);
    return {first, first + static_cast<std::ptrdiff_t>(blocks_per_chunk)};
  }

  // Checks that `tokens` and `block_ids` cover chunks [first, first + count): kInvalidArgument
  // saying which falls short.
  Status covers(std::span<const std::uint32_t> tokens, std::span<const std::uint32_t> block_ids,
                std::size_t first, std::size_t count) const;
};

// A save's chunks. save_layer (the caller's thread) queues one task per chunk and layer on
// the cache's savers; a chunk's tasks run one after another (each waits for `last`), so a
// Chunk is touched by one thread at a time. `cancelled` is the one field read across threads.
struct KvSave::State {
  const KvCache::Impl* kv = nullptr;
  struct Chunk {
    std::string key;
    std::vector<std::uint32_t> blocks;
    PutStream stream;
    Status status;                            // the first failure
    std::shared_future<void> last;            // the chunk's latest layer task: its next one waits for it
    std::unique_ptr<kvcache::Bounce> bounce;  // staged: bounce_slots layers
  };
  std::vector<Chunk> chunks;
  Deadline deadline;  // the save's: a layer whose engine work is not done by then fails
  std::uint32_t next_layer = 0;
  bool waited = false;
  std::atomic<bool> cancelled = false;

  // A saver's task: once the engine's work up to `written` is done, starts writing `layer` of
  // `c` (summed by the device on the direct path to device memory; gathered into a bounce
  // slot, staged), its checksum one segment of the chunk's stream. Does nothing for a chunk that failed;
  // the first failure goes to c.status. Blocks until the engine's mark passes (or the
  // deadline, or cancel()), and, staged, until the slot's previous layer was written.
  void write_layer(Chunk& c, std::uint32_t layer, KvDeviceMark& written);
  // Waits for the engine's mark in short steps, so that cancel() is not held up by engine
  // work that never finishes: OK, the mark's error, kTimeout at the deadline, kCancelled.
  Status wait_for(KvDeviceMark& mark) const;
  // Waits for every layer task (they touch the chunks).
  void drain();
  // Drains, then aborts every stream and gives the bounce buffers back.
  ~State();
};

// A load's chunks. `mu` guards verified, done and signals; blocks and tasks are written
// before the first task runs and read-only after.
struct KvLoad::State {
  std::uint32_t layers = 0;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<std::uint32_t> verified;             // per chunk: leading layers landed and checked
  std::vector<std::optional<Status>> done;         // per chunk: the final status
  std::vector<std::vector<std::uint32_t>> blocks;  // per chunk: where it loads
  std::vector<std::future<void>> tasks;
  CancelToken cancel = CancelToken::make();  // every chunk's get holds it
  std::shared_ptr<KvDevice> device;
  std::unique_ptr<KvDeviceSignals> signals;  // made at the first layer_event()

  // Loads chunk `c` (status c) from the object `key` into blocks[c]: one store get (until
  // `deadline`), whose progress checks each layer against the checksum its save recorded as
  // soon as it is whole (staged: in a bounce buffer, then scattered into the cache), raising
  // verified[c] and waking wait_layer layer by layer. Ends by setting done[c]: the get's
  // error; kCorrupt for an object not saved by this layout, a layer that does not match, or
  // a size that is not a chunk's; kCancelled when cancel() stopped it; the layer runs' or
  // bounce buffer's error before any byte moves. Blocks until the get returned (a loader
  // thread's task); `kv` and `key` outlive the call.
  void load_chunk(const KvCache::Impl& kv, std::size_t c, const std::string& key,
                  std::optional<Deadline> deadline);

  // Whether every chunk has checked `layer` or ended. Holds `mu`.
  bool ready_locked(std::uint32_t layer) const;
  // Wakes wait_layer and completes the device events of every layer now ready. Holds `mu`.
  void progress_locked();
  ~State();  // completes every device event: no engine stream waits forever

 private:
  class ChunkLoad;  // load_chunk's steps (kv_load.cc)
};

}  // namespace kvstash
