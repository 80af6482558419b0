// kvstash/kvcache.h: an inference engine's paged KV cache as kvstash moves it.
//
// An engine does not hold a session's KV cache as one buffer: vLLM keeps, per layer, a tensor
// of shape (2, num_blocks, block_size, num_kv_heads, head_dim) (NHD; HND swaps the last but
// one axes), and a request owns a list of block ids. KvLayout describes where every (layer,
// K or V, block) lives; prefix_chunk_keys() names the chunks of a token sequence so that any
// process, host or restart finds the same objects; KvCache saves and loads a request's
// chunks through a Store.
//
//   KvCacheShape shape{.num_layers = 32, .num_blocks = 4096, .block_size = 16,
//                      .num_kv_heads = 32, .head_dim = 128, .dtype = KvDType::kFloat16};
//   auto layout = KvLayout::per_layer(shape, layer_tensors).value();
//   auto kv = KvCache::open(*store, std::move(layout), {.model = "llama-2-7b"}).value();
//   std::size_t hit = kv->contains_prefix(tokens).value();    // leading chunks stored
//   auto st = kv->load(tokens, block_ids, hit);                // one Status per chunk
//   auto saved = kv->save(tokens, block_ids, hit, n - hit);    // after the forward pass
//
// An object holds one chunk of `chunk_tokens` tokens, all layers, in a canonical order:
// layer by layer, within a layer K then V (or the MLA latent alone), within those the
// chunk's blocks in token order, each block's bytes as the engine keeps them (NHD or HND:
// part of the key's salt, so caches of different layouts never share objects). Its object
// layout (PutOptions::object_layout) holds the layout tag and each layer's checksum ("<tag>;xxh3=<16
// hex>,...": the sum of the layer as one checksum segment, computed by the device where the bytes are), which
// a layer-wise load checks as each layer lands, on the device.
//
// Thread safety: KvLayout is a value; KvCache is safe to use from several threads.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/memory.h"
#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash {

class Store;

enum class KvDType : std::uint8_t { kFloat16, kBFloat16, kFloat32, kFloat8E4M3, kFloat8E5M2, kInt8 };

std::size_t dtype_bytes(KvDType t);
std::string_view to_string(KvDType t);  // "fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8"
std::optional<KvDType> parse_kv_dtype(std::string_view s);  // the names above, and "fp8" = fp8_e4m3

// Order of one block's elements: NHD (block_size, kv_heads, head_dim) or HND (kv_heads,
// block_size, head_dim).
enum class KvBlockOrder : std::uint8_t { kNHD, kHND };

struct KvCacheShape {
  std::uint32_t num_layers = 0;
  std::uint32_t num_blocks = 0;    // blocks per layer
  std::uint32_t block_size = 0;    // tokens per block
  std::uint32_t num_kv_heads = 0;  // MLA: 1
  std::uint32_t head_dim = 0;      // MLA: the latent width (kv_lora_rank + rope dims)
  KvDType dtype = KvDType::kFloat16;
  KvBlockOrder order = KvBlockOrder::kNHD;
  bool mla = false;  // one latent tensor per layer, no K/V split
  // One part per layer with K and V side by side in each token's head: head_dim is K's and V's
  // widths together (vLLM's pages, [blocks, heads, tokens, content]).
  bool joint_kv = false;

  std::uint32_t parts() const { return mla || joint_kv ? 1 : 2; }
  // Bytes of one block of one part (K, V or latent) of one layer.
  std::uint64_t block_bytes() const;
  // Bytes one token takes over all layers and parts: 2 x layers x kv_heads x head_dim x dtype.
  std::uint64_t bytes_per_token() const;
  // kInvalidArgument naming the first zero or overflowing dimension.
  Status validate() const;
};

// One contiguous run of a cache's memory: `length` bytes at `addr`, inside region `region`.
struct KvRun {
  std::byte* addr = nullptr;
  std::uint64_t length = 0;
  std::uint32_t region = 0;
};

// Where every block of a KV cache is. The byte address of (layer l, part p, block b) is
//   layer_base[l] + p * part_stride + b * block_stride
// and `regions` are the memory that holds it all (one per layer, or one for every layer),
// registered once with the store.
class KvLayout {
 public:
  // vLLM's per-layer tensors: layer l is (2, num_blocks, block_size, kv_heads, head_dim)
  // (FlashAttention's kv-first shape), or (num_blocks, block_size, head_dim) with MLA.
  static Result<KvLayout> per_layer(const KvCacheShape& shape, std::span<void* const> layer_tensors,
                                    MemoryKind memory_kind = MemoryKind::kHost);
  // Blocks first: layer l is (num_blocks, 2, block_size, kv_heads, head_dim) (FlashInfer).
  static Result<KvLayout> per_layer_blocks_first(const KvCacheShape& shape,
                                                 std::span<void* const> layer_tensors,
                                                 MemoryKind memory_kind = MemoryKind::kHost);
  // One region for every layer: (num_blocks, num_layers, 2, block_size, kv_heads, head_dim),
  // vLLM's cross-layer layout, where one block of every layer is contiguous.
  static Result<KvLayout> cross_layer(const KvCacheShape& shape, void* base,
                                      MemoryKind memory_kind = MemoryKind::kHost);
  // Any other arrangement, by strides. Checked: every block of every layer and part must lie
  // inside one of `regions`, and no two may overlap.
  static Result<KvLayout> custom(const KvCacheShape& shape, std::vector<std::byte*> layer_base,
                                 std::uint64_t part_stride, std::uint64_t block_stride,
                                 std::vector<MemoryRegion> regions);

  // The same memory seen as heads [first, first + count) only: its shape has `count` heads, and
  // its runs hold of each block just those heads' bytes (one run per block in HND order, one
  // per token in NHD order). A view of a view is not taken. kInvalidArgument for an MLA cache
  // or heads out of range.
  Result<KvLayout> heads(std::uint32_t first, std::uint32_t count) const;
  // Whether this is a view of some heads of wider blocks (heads()).
  bool is_head_view() const { return tensor_heads_ != 0; }

  const KvCacheShape& shape() const { return shape_; }
  const std::vector<MemoryRegion>& regions() const { return regions_; }

  // Bytes one layer of `blocks` blocks takes in an object (every part).
  std::uint64_t layer_bytes(std::size_t blocks) const {
    return shape_.parts() * blocks * shape_.block_bytes();
  }

  // Appends the memory of `blocks` of `layer` in object order (part by part, blocks in the
  // given order), merging blocks that follow each other in memory into one run. Errors:
  // kInvalidArgument for a layer or block id out of range.
  Status layer_runs(std::uint32_t layer, std::span<const std::uint32_t> blocks,
                    std::vector<KvRun>& out) const;

  // What keys must be salted with: the shape, dtype and block order
  // ("L32.P2.H32.D128.B16.fp16.nhd").
  std::string tag() const;

  // The address arithmetic above, for describing the layout to a peer (KvExport).
  std::byte* layer_base(std::uint32_t layer) const { return layer_base_[layer]; }
  std::uint32_t layer_region(std::uint32_t layer) const { return layer_region_[layer]; }
  std::uint64_t part_stride() const { return part_stride_; }
  std::uint64_t block_stride() const { return block_stride_; }

 private:
  KvCacheShape shape_;
  std::vector<std::byte*> layer_base_;
  std::uint64_t part_stride_ = 0;
  std::uint64_t block_stride_ = 0;
  std::vector<MemoryRegion> regions_;
  std::vector<std::uint32_t> layer_region_;  // region holding each layer's blocks
  std::uint32_t tensor_heads_ = 0;           // a head view: the heads of the blocks in memory
  std::uint32_t head_first_ = 0;             // and the first of them it holds
};

// How chunk keys are salted: everything that changes a chunk's bytes besides its tokens.
//
// Tensor parallelism, two ways. By rank (heads_total 0): each rank's keys name its rank and
// degree, so only a reader of the same degree finds them. By heads (heads_total set): an
// object holds `head_count` of the model's `heads_total` KV heads, from `head_first` on, and
// its key says which ("...:h4+2/8"), not who wrote it; a rank of any degree reads the
// objects of exactly the heads it holds. A KvCache over a rank's tensors takes head_first as
// the global index of the rank's first head and head_count as the heads per object, which
// must divide the rank's heads: each chunk is then (rank's heads / head_count) objects.
//
// Pipeline parallelism (layers_total set): each stage's objects hold its layers,
// [layer_first, layer_first + layer_count) of the model's layers_total, and their keys say so
// (":l0+16/32" before any heads). The chain is the whole model's (the layout tag is hashed
// with layers_total layers), so every stage's objects of a chunk live in one cell and a lookup
// asks for all of them at once. A KvCache takes layer_count from its layout.
struct PrefixKeyOptions {
  std::string model;       // the model's identity ("meta-llama/Llama-2-7b-hf@<revision>")
  std::string layout_tag;  // KvLayout::tag(); KvCache fills it in
  std::uint32_t tp_rank = 0;
  std::uint32_t tp_size = 1;
  std::uint32_t chunk_tokens = 256;
  std::string extra;              // anything else that changes the bytes (a LoRA adapter, ...)
  std::uint32_t heads_total = 0;  // the model's KV heads; 0: keys name the rank
  std::uint32_t head_first = 0;
  std::uint32_t head_count = 0;
  std::uint32_t layers_total = 0;  // the model's layers; 0: an object holds every layer
  std::uint32_t layer_first = 0;
  std::uint32_t layer_count = 0;
  // A KV-cache group of a hybrid model (its kind and layers, "swa128.<digest>"): the objects of
  // one chunk's groups share its chain (one route, one lookup), and each key ends in
  // ":g<group>.<the layout tag's digest>". Empty: a model of one group.
  std::string group;
};

// A request's tokens as its chunk keys name them: the token ids and, for a chunk whose KV
// was computed from more than its ids and the chunks before it (a multimodal item whose
// placeholder tokens it holds, prompt embeddings in place of ids), a salt that names that
// input by its content (a digest). chunk_salts[c] goes into chunk c's link of the key chain,
// so it reaches every later chunk's key too; an empty salt, or none past the span's end, adds
// nothing. Both spans are the caller's and must outlive the call.
struct KvTokens {
  std::span<const std::uint32_t> ids;
  std::span<const std::string> chunk_salts;

  KvTokens() = default;
  KvTokens(std::span<const std::uint32_t> token_ids, std::span<const std::string> salts = {})
      : ids(token_ids), chunk_salts(salts) {}
  // Any contiguous range of token ids (a std::vector<std::uint32_t>, ...), without salts.
  template <class Range>
  requires std::convertible_to<const Range&, std::span<const std::uint32_t>> KvTokens(const Range& token_ids)
      : ids(token_ids) {}  // NOLINT(google-explicit-constructor)

  // The first `n` ids, with the salts of the chunks they hold.
  KvTokens first(std::size_t n) const { return {ids.first(n), chunk_salts}; }
};

// The keys of the full chunks of `tokens` ("kvp:" + 32 hex digits each): a SHA-256 chain
// over the token ids and chunk salts, so chunk i's key depends on everything before its end,
// salted with the options. Deterministic across processes, hosts and restarts; the exact
// bytes hashed are in docs/integration.md. A trailing partial chunk has no key. Keys of a
// pipeline stage end in ":l<layer_first>+<layer_count>/<layers_total>", keys of a KV-cache
// group in ":g<group>.<8 hex digits of the layout tag's SHA-256>", keys by heads in
// ":h<head_first>+<head_count>/<heads_total>" (in that order).
std::vector<std::string> prefix_chunk_keys(const KvTokens& tokens, const PrefixKeyOptions& options);
// By heads: the keys of `groups` objects of head_count heads each from head_first on (a
// rank's objects, or with head_first 0 every object of the model), chunk by chunk, the chain
// hashed once. groups 1 is prefix_chunk_keys.
std::vector<std::string> prefix_object_keys(const KvTokens& tokens, const PrefixKeyOptions& options,
                                            std::uint32_t groups);

class KvCache;

// What a request's loads and saves tell a turn-ttl cell of it (a KeepHint per object): from
// its prefix lookup (KvCache::lookup_prefix, or Store::lookup_prefix over keys of one's own).
// Under another policy the cell ignores it.
struct KvKeep {
  std::uint32_t turn = 1;        // the request's conversation turn (PrefixLookup::turn)
  double looked_up = 0;          // the cell's clock at the lookup (PrefixLookup::clock)
  std::uint32_t chunks = 0;      // the prompt's chunks the request looks up and saves
  std::uint64_t split_hash = 0;  // KeepHint::hash_key of the first chunk missing (else the last)
};

// A request's prefix lookup (KvCache::lookup_prefix).
struct KvLookup {
  std::size_t chunks = 0;  // leading full chunks stored (contains_prefix)
  KvKeep keep;             // for the request's begin_load and begin_save
};

// A point in an inference engine's GPU work, as the engine holds it (not owned), that the
// cache orders its own work after. The three kinds, as CUDA defines them:
//
//   KvSync::stream(s)  everything queued on stream `s` up to the call (a cudaStream_t;
//                      torch.cuda.Stream.cuda_stream). As in CUDA, a null handle IS a stream:
//                      the legacy default stream of the device (torch's default stream has
//                      handle 0), whose work orders after every blocking stream of the device.
//                      cudaStreamPerThread (0x2) is the calling thread's per-thread stream.
//   KvSync::event(e)   an event the engine recorded (a cudaEvent_t; torch.cuda.Event.cuda_event),
//                      as recorded at the call (the engine may record it again afterwards).
//   KvSync::none()     nothing to wait for: the engine vouches that the memory is final (it
//                      synchronized itself, or a CPU wrote a host cache).
//
// The default, KvSync{}, is the legacy default stream: "nothing" is never what an unset or null
// handle means. A device stand-in (tests/gpu/device_standin.h) takes its own handles.
struct KvSync {
  enum class Kind : std::uint8_t { kStream, kEvent, kNone };
  Kind kind = Kind::kStream;
  void* handle = nullptr;

  static KvSync stream(void* s) { return {Kind::kStream, s}; }
  static KvSync event(void* e) { return {Kind::kEvent, e}; }
  static KvSync none() { return {Kind::kNone, nullptr}; }
};

// What a device sizes its per-operation resources for (KvDevice::reserve).
struct KvDeviceSizes {
  std::size_t runs_per_layer = 0;  // runs of one chunk's layer, at most (parts x blocks per chunk)
  std::uint64_t layer_bytes = 0;   // one chunk's layer
  std::uint32_t layers = 0;
  std::size_t chunks = 8;  // chunks per load that a warm load needs no allocation for
};

// A point in a device's work the host can wait for (an event recorded on a stream).
class KvDeviceMark {
 public:
  virtual ~KvDeviceMark() = default;
  // Blocks until the device passed the mark: OK, kTimeout at the deadline, or the device's error.
  virtual Status wait(Deadline deadline) = 0;
};

// What a load hands to the engine's streams: where each chunk's layers go.
struct KvHandoverPlan {
  bool staged = false;  // layers land in host bounce buffers (else: in the cache, by the NIC)
  std::uint32_t layers = 0;
  std::uint64_t layer_bytes = 0;  // one chunk's layer, every part
  // runs[c][l]: where layer l of chunk c goes in the cache's memory, in object order.
  std::vector<std::vector<std::vector<KvRun>>> runs;
  // The engine's work that last used the blocks (KvLoad's `after`): a stream that finishes a
  // layer waits for it too. Not owned; outlives the handover. Null: nothing.
  KvDeviceMark* after = nullptr;
};

// One load's layers, handed to the engine's streams (KvLoad::wait_layer_on). The host releases
// layers in order as they become final on the host (landed, and staged: checked); a stream
// that queued a layer waits, on the device, for that release alone, and then finishes the
// layer itself, ahead of the engine's work: staged, it copies each chunk's layer from its
// bounce buffer into the cache; direct, it checksums each chunk's layer where the NIC put it.
// So a device-side wait depends only on host (and NIC) progress, never on other device work
// of kvstash's, which might sit behind it in a shared hardware queue.
//
// Thread safety: every method may be called from any thread.
class KvDeviceHandover {
 public:
  // Releases every layer first (no stream waits forever); never blocks. Work already queued
  // still runs: keep what it reads (bounce buffers, the cache) until passed() said true.
  virtual ~KvDeviceHandover() = default;
  // Staged: layer `layer` of chunk `chunk` passed its check at host address `src` (layer_bytes):
  // the stream that finishes the layer copies it from there. A chunk's layer never placed is
  // not copied (its blocks keep what they held). Call before the release of `layer`.
  virtual void place(std::size_t chunk, std::uint32_t layer, const std::byte* src) = 0;
  // Layers [0, n) are final on the host (or their chunk failed): streams may go past them.
  // n only grows.
  virtual void release_through(std::uint32_t n) = 0;
  // Queues on the engine's `stream` (a cudaStream_t; null is the legacy default stream): the
  // wait for layer `layer`'s release, then the layer's finishing work. Does not block.
  // kInvalidArgument for a stream the device cannot use (one capturing a CUDA graph), the
  // device's errors otherwise.
  virtual Status queue(std::uint32_t layer, void* stream) = 0;
  // The same on a stream of the handover's own, and an event that completes once it ran (a
  // cudaEvent_t; owned by the handover).
  virtual Result<void*> queue_event(std::uint32_t layer) = 0;
  // Direct: the checksum of layer `layer` of chunk `chunk` (one segment) as the stream that
  // finished the layer computed it; blocks until it ran, or `deadline` (kTimeout).
  // kUnavailable when the layer was never queued.
  virtual Result<std::uint64_t> sum(std::size_t chunk, std::uint32_t layer, Deadline deadline) = 0;
  // Whether every piece of queued work ran, so that what it reads may be reused. Never blocks.
  virtual bool passed() = 0;
};

// The device that owns a KV cache's memory, as the KV-cache layer drives it. Its memory may
// be out of the host's reach (GPU memory): the host never reads or writes it. The device
// copies it to and from host bounce buffers (the staged data path), computes its checksums
// where it is (both paths), and orders the cache's work after the engine's streams.
//
// The CUDA device (src/kvcache/cuda/cuda_device.h, built where the CUDA toolkit is found)
// does each with kernels and events; host_device() serves memory the host may touch;
// tests/gpu/device_standin.h is a device made of memory the test process cannot touch. Every
// blocking call returns by its deadline (kTimeout). Implementations are thread-safe: saver
// and loader threads call them at once.
class KvDevice {
 public:
  virtual ~KvDevice() = default;
  virtual std::string_view name() const = 0;
  // Sizes what the device keeps per operation for a cache of this geometry (KvCache::open),
  // so that warm copies, checksums and loads allocate nothing. A larger request later still
  // works (it allocates then).
  virtual Status reserve(const KvDeviceSizes& sizes) = 0;
  // Copies `runs` in order into host memory `dst`, contiguous; returns once the bytes are there.
  virtual Status gather(std::span<const KvRun> runs, std::byte* dst, Deadline deadline) = 0;
  // Copies contiguous host `src` into `runs`, in order; returns once the bytes are there.
  virtual Status scatter(const std::byte* src, std::span<const KvRun> runs, Deadline deadline) = 0;
  // Host memory suited to bounce buffers (page-locked for CUDA), freed by the deleter.
  virtual Result<std::shared_ptr<std::byte>> allocate_host(std::size_t bytes) = 0;
  // The checksum of the bytes of `runs`, in order, as one segment (docs/metadata.md: the
  // xxh3 tree, common/checksum_core.h), computed by the device where the bytes are.
  // `nic_wrote`: a NIC wrote them (a load's direct path), so its writes are made visible to
  // the device first where the device needs that. Returns once known.
  virtual Result<std::uint64_t> segment_sum(std::span<const KvRun> runs, bool nic_wrote,
                                            Deadline deadline) = 0;
  // The engine's work up to `after`, as a mark the cache's threads wait for. Does not block
  // (called on the engine's thread). kInvalidArgument for a handle the device cannot use.
  virtual Result<std::unique_ptr<KvDeviceMark>> mark(const KvSync& after) = 0;
  // A load's handover to the engine's streams (KvLoad::wait_layer_on). kUnsupported where the
  // device has no streams (the host).
  virtual Result<std::unique_ptr<KvDeviceHandover>> handover(const KvHandoverPlan& plan) = 0;
};

// Memory the host may touch: memcpy, checksums on the CPU, no streams. mark() passes at once
// for KvSync::none() and for the legacy default stream (a host cache has no GPU work to order
// after); any other handle is kInvalidArgument. handover() is kUnsupported.
std::shared_ptr<KvDevice> host_device();

// The CUDA device of GPU `gpu` (a CUDA ordinal): the cache's copies and checksums run as
// kernels on that GPU. It makes GPU `gpu`'s primary context current around each of its calls
// and restores the caller's, so no thread of kvstash's or of the caller's gains a context on
// another GPU, and the caller's current device is as it was. kUnsupported where this build
// has no CUDA kernels; kUnavailable when there is no usable GPU, or the driver is older than
// the CUDA runtime this build links needs (the message names the driver floor: R580 for CUDA
// 13, R525 for CUDA 12); kInternal for other CUDA errors.
Result<std::shared_ptr<KvDevice>> cuda_device(int gpu);

// The CUDA device of the GPU that owns `layout`'s memory (not GPU 0): what KvCache uses for
// GPU memory when KvCacheOptions::device is unset. Errors as cuda_device's, and
// kInvalidArgument when the memory is not CUDA device memory.
Result<std::shared_ptr<KvDevice>> cuda_device_of(const KvLayout& layout);

// How a cache's bytes travel.
enum class KvPath : std::uint8_t {
  kAuto,    // direct where every transport in use registers the cache's memory, else staged
  kDirect,  // the transports move the cache's memory themselves (GPUDirect for GPU memory)
  kStaged,  // the device copies through host bounce buffers, which the transports move
};

struct KvCacheOptions {
  // The device that owns the cache's memory. Unset: host_device() for host memory; for GPU
  // memory, cuda_device_of(layout) (where this build has the CUDA kernels).
  std::shared_ptr<KvDevice> device;
  KvPath path = KvPath::kAuto;
  // Bounce buffers per chunk being saved, one layer each: a layer's gather overlaps the
  // network writes of the `bounce_slots - 1` before it.
  std::uint32_t bounce_slots = 3;
};

// A save in progress, layer by layer: each chunk's object is reserved at begin_save, and
// save_layer(l) starts writing layer l of every chunk as soon as the engine's attention has
// written it (layers in order, 0 first). wait() commits each chunk once all its layers went
// out. Destroying an unfinished save drops it (nothing becomes visible).
class KvSave {
 public:
  KvSave();
  KvSave(KvSave&&) noexcept;
  KvSave& operator=(KvSave&&) noexcept;
  ~KvSave();
  // Starts writing `layer` (the next one in order) of every chunk still alive, once the
  // engine's work up to `after` is done (the attention kernel that wrote the layer): the
  // cache's threads wait for it, the caller does not. The default is CUDA's legacy default
  // stream (KvSync). Returns once queued. kInvalidArgument out of order or for a handle the
  // device cannot use (a stream capturing a CUDA graph among them); a chunk whose write fails
  // (or whose `after` never completes before the save's deadline) is reported by wait().
  Status save_layer(std::uint32_t layer, const KvSync& after = {});
  // Waits for every write and commits: one Status per chunk (kInvalidArgument for a chunk
  // whose layers were not all saved; kCancelled after cancel()). All chunks' commits, and
  // their event data (begin_save's `events`), go to Redis in one script.
  std::vector<Status> wait();
  // The keys of the objects the save writes, chunk by chunk (KvCache::objects_per_chunk()
  // each), as KvCache::keys names them.
  std::vector<std::string> keys() const;
  // After wait(): how many chunks' event data the cell recorded (0 while its events are off).
  std::size_t announced() const;
  // Drops the save: returns once no transfer reads the cache's memory any more; nothing
  // becomes visible, the reserved pages go back. save_layer fails afterwards.
  void cancel();

 private:
  friend class KvCache;
  struct State;
  std::unique_ptr<State> state_;
};

// A load in progress. Every layer of every chunk is checked against the checksum its save
// recorded as soon as it lands, so an engine may compute layer l while later layers arrive.
//
// Two ways to wait for a layer, which may be mixed:
// - wait_layer(l): the host blocks until layer l of every chunk is in place and checked.
// - wait_layer_on(l, stream): the engine's stream waits, on the GPU, for the layer's bytes to
//   land, and then places (staged) or checks (direct) the layer itself, ahead of the engine's
//   later work on it; the engine's thread never blocks. A layer that fails its check there is
//   reported by wait() and failed_blocks(), which an engine reads before it returns the
//   step's tokens (vLLM: get_block_ids_with_load_errors), so a corrupt layer never reaches a
//   token the engine returns. Once a load has handed a layer to a stream, the cache's own
//   threads stop placing layers as they land; wait() places any layer no one asked for.
// The load must not outlive its KvCache.
class KvLoad {
 public:
  KvLoad();
  KvLoad(KvLoad&&) noexcept;
  KvLoad& operator=(KvLoad&&) noexcept;
  ~KvLoad();  // waits for the transfers (the memory is the engine's); does not wait for streams
  // Blocks until `layer` of every chunk is in place and matched its checksum, or the chunk
  // failed: OK, or the first failed chunk's status (its later layers cannot be trusted). A
  // layer handed to a stream (wait_layer_on) is placed by that stream: then this waits for
  // the layer to land (and, staged, pass its check) only.
  Status wait_layer(std::uint32_t layer);
  // Non-blocking form: whether the layer is final on the host (wait_layer would not wait for
  // the network).
  bool layer_ready(std::uint32_t layer) const;
  // Queues on the engine's `stream` (a cudaStream_t; null: the legacy default stream) a
  // device-side wait for the layer's bytes and the device work that places or checks them;
  // the engine's later work on the stream sees the layer in place. Does not block. The wait
  // also ends for a failed chunk: failed_blocks() says what to recompute.
  // kUnsupported on the host device (use wait_layer), kInvalidArgument out of range, after
  // wait(), or for a stream the device cannot use (one capturing a CUDA graph).
  Status wait_layer_on(std::uint32_t layer, void* stream);
  // The same on a stream of the load's own, as an event (cudaEvent_t on the CUDA device) that
  // completes once the layer is in place, for cudaStreamWaitEvent. Owned by the load; valid
  // until it is destroyed. Errors as wait_layer_on.
  Result<void*> layer_event(std::uint32_t layer);
  // Waits for everything: one Status per chunk. Places (and checks) every layer no stream was
  // handed; a layer a stream checks is waited for up to the load's deadline (direct path).
  std::vector<Status> wait();
  // Waits for everything, then the ids of the blocks whose chunk did not load whole (evicted,
  // corrupt, cancelled, timed out), in chunk order: what the engine must recompute. Empty
  // when every chunk landed.
  std::vector<std::uint32_t> failed_blocks();
  // Waits for everything: one Status per object (KvCache::objects_per_chunk() a chunk, in
  // order), where wait() folds them per chunk: which object of a chunk failed, and how.
  std::vector<Status> object_statuses();
  // Stops the load: returns once nothing writes into the cache's memory any more. Chunks
  // that had landed keep their status; the rest end kCancelled (their blocks hold partial
  // data: recompute them), and so does wait_layer for a layer they had not reached.
  void cancel();

 private:
  friend class KvCache;
  struct State;
  std::shared_ptr<State> state_;
};

// A KV cache bound to a store: saves and loads chunks of requests' blocks.
class KvCache {
 public:
  // Registers the layout's regions with the store's engine. `keys.layout_tag` is set from the
  // layout (by heads: from one object's heads). Errors: kInvalidArgument (chunk_tokens not a
  // positive multiple of block_size, empty model, heads that do not fit: see
  // PrefixKeyOptions), registration errors.
  static Result<std::unique_ptr<KvCache>> open(Store& store, KvLayout layout, PrefixKeyOptions keys,
                                               KvCacheOptions options = {});
  ~KvCache();

  const KvLayout& layout() const;  // the whole of the cache's memory
  const PrefixKeyOptions& key_options() const;
  // "direct" (the transports reach the cache's memory), or "staged" (through host bounce
  // buffers, by the device).
  std::string_view data_path() const;
  // The device that owns the cache's memory ("host", "cuda", ...).
  const KvDevice& device() const;
  // The keys of the objects of every full chunk, chunk by chunk: objects_per_chunk() each.
  std::vector<std::string> keys(const KvTokens& tokens) const;
  // Objects one chunk is stored as: 1, or by heads, the cache's heads / heads per object.
  std::size_t objects_per_chunk() const;
  // Bytes of one object of a chunk.
  std::uint64_t chunk_bytes() const;

  // How many leading full chunks of `tokens` the store holds.
  Result<std::size_t> contains_prefix(const KvTokens& tokens, std::optional<Deadline> deadline = {});
  // contains_prefix (one round trip too), with what the request's loads and saves tell a
  // turn-ttl cell (pass `keep` on to them: without it, the cell keeps their chunks as LRU
  // would).
  Result<KvLookup> lookup_prefix(const KvTokens& tokens, std::optional<Deadline> deadline = {});

  // Saves chunks [first, first + count) of a request: `block_ids[i]` holds tokens
  // [i * block_size, (i + 1) * block_size). One Status per chunk: a chunk that failed can be
  // saved again (or recomputed) alone. kInvalidArgument for every chunk when the tokens or
  // blocks do not cover them.
  std::vector<Status> save(const KvTokens& tokens, std::span<const std::uint32_t> block_ids,
                           std::size_t first, std::size_t count, std::optional<Deadline> deadline = {},
                           const std::optional<KvKeep>& keep = {});

  // Loads the first `count` chunks into `block_ids`' blocks. One Status per chunk
  // (kNotFound for one evicted meanwhile: recompute from there).
  std::vector<Status> load(const KvTokens& tokens, std::span<const std::uint32_t> block_ids,
                           std::size_t count, std::optional<Deadline> deadline = {},
                           const std::optional<KvKeep>& keep = {});

  // Layer-wise forms. begin_save reserves chunks [first, first + count) (the tokens and
  // blocks are copied; the blocks' memory must not change until wait() returned). Errors
  // for the whole request: kInvalidArgument (tokens or blocks do not cover the chunks);
  // per chunk (kNoSpace, ...) through wait(). `keep` (here and in the loads): the request's
  // lookup's, for a turn-ttl cell. `events`: none, or each chunk's event data for routers
  // (docs/events.md), which the commit of the chunk's first object records
  // (PutOptions::event); kInvalidArgument for another count.
  Result<KvSave> begin_save(const KvTokens& tokens, std::span<const std::uint32_t> block_ids,
                            std::size_t first, std::size_t count, std::optional<Deadline> deadline = {},
                            const std::optional<KvKeep>& keep = {}, std::span<const std::string> events = {});
  // Starts loading the first `count` chunks; every chunk's transfer runs at once. No byte of
  // the blocks is written before the engine's work up to `after` is done (the blocks may have
  // belonged to a request whose kernels still read them; the default is the legacy default
  // stream, as KvSync says). kInvalidArgument for a handle the device cannot use.
  Result<KvLoad> begin_load(const KvTokens& tokens, std::span<const std::uint32_t> block_ids,
                            std::size_t count, std::optional<Deadline> deadline = {},
                            const KvSync& after = {}, const std::optional<KvKeep>& keep = {});
  // Chunks [first, first + count) only (the engine already holds the ones before, e.g. in
  // its own prefix cache); the KvLoad's statuses count from chunk `first`.
  Result<KvLoad> begin_load_range(const KvTokens& tokens, std::span<const std::uint32_t> block_ids,
                                  std::size_t first, std::size_t count, std::optional<Deadline> deadline = {},
                                  const KvSync& after = {}, const std::optional<KvKeep>& keep = {});

 private:
  friend class KvSave;
  friend class KvLoad;
  struct Impl;
  explicit KvCache(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash
