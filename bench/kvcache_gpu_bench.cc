// `kvstash-bench kvcache --gpu`: the staging path on a GPU. One Llama-2-7B session whose
// blocks are scattered over a paged cache in GPU memory: the CUDA device's gather of every
// layer's scattered blocks into pinned memory and scatter back (the staging step alone), and
// the whole save and load layer by layer through the store, each against cudaMemcpy of the
// same bytes device-to-host and host-to-device (pinned) in the same run. Every loaded block
// verified.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>

#include <nlohmann/json.hpp>

#include "common/units.h"
#include "kvcache_bench.h"
#include "kvcache/cuda/cuda_device.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"
#include "measure.h"

namespace kvstash::bench {
namespace {

bool cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::cerr << "kvstash-bench kvcache --gpu: " << what << ": " << cudaGetErrorString(e) << "\n";
  return false;
}

}  // namespace

int run_kvcache_gpu(const KvCacheBenchOptions& o) {
  auto planned = plan_session(o);
  if (!planned.is_ok()) {
    std::cerr << "kvstash-bench kvcache --gpu: " << planned.status().message() << "\n";
    return 2;
  }
  const KvCacheShape& shape = planned->shape;
  const std::uint64_t session = planned->bytes;
  const auto& blocks_src = planned->blocks_src;
  const auto& blocks_dst = planned->blocks_dst;
  const std::size_t used = blocks_src.size();
  auto gpu = cuda::cuda_device(0);
  if (!gpu.is_ok()) {
    std::cerr << "kvstash-bench kvcache --gpu: " << gpu.status().to_string() << "\n";
    return 1;
  }
  const std::uint64_t bb = shape.block_bytes(), layer_bytes = 2ull * shape.num_blocks * bb;

  // Two caches on the GPU, the source random, the destination poisoned; a contiguous device
  // buffer and a pinned host one of the session's size for the cudaMemcpy reference.
  std::vector<void*> src(shape.num_layers), dst(shape.num_layers);
  std::vector<std::vector<unsigned char>> host(shape.num_layers, std::vector<unsigned char>(layer_bytes));
  std::mt19937_64 rng(1);
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    for (std::size_t i = 0; i + 8 <= layer_bytes; i += 8) {
      const std::uint64_t x = rng();
      std::memcpy(host[l].data() + i, &x, 8);
    }
    if (!cuda_ok(cudaMalloc(&src[l], layer_bytes), "cudaMalloc") ||
        !cuda_ok(cudaMalloc(&dst[l], layer_bytes), "cudaMalloc") ||
        !cuda_ok(cudaMemcpy(src[l], host[l].data(), layer_bytes, cudaMemcpyHostToDevice), "fill") ||
        !cuda_ok(cudaMemset(dst[l], 0x5a, layer_bytes), "poison")) {
      return 1;
    }
  }
  void* flat_dev = nullptr;
  void* flat_host = nullptr;
  if (!cuda_ok(cudaMalloc(&flat_dev, session), "cudaMalloc") ||
      !cuda_ok(cudaHostAlloc(&flat_host, session, cudaHostAllocDefault), "cudaHostAlloc")) {
    return 1;
  }

  auto cell = start_bench_cell(session + (64ull << 20));
  if (!cell.is_ok()) return std::cerr << cell.status().to_string() << "\n", 1;
  auto store = open_bench_store(*cell, o.transports.empty() ? TransportKind::kShm : o.transports.front());
  if (!store.is_ok()) return std::cerr << store.status().to_string() << "\n", 1;
  auto kv_src = KvCache::open(**store, KvLayout::per_layer(shape, src, MemoryKind::kCuda).value(),
                              {.model = "llama-2-7b"}, {.device = *gpu, .path = KvPath::kStaged});
  auto kv_dst = KvCache::open(**store, KvLayout::per_layer(shape, dst, MemoryKind::kCuda).value(),
                              {.model = "llama-2-7b"}, {.device = *gpu, .path = KvPath::kStaged});
  if (!kv_src.is_ok() || !kv_dst.is_ok()) {
    std::cerr << "kvstash-bench kvcache --gpu: "
              << (kv_src.is_ok() ? kv_dst.status() : kv_src.status()).to_string() << "\n";
    return 1;
  }

  // The staging step alone: each layer's scattered blocks gathered by the device into one
  // pinned buffer of the session's size, then scattered into the destination cache.
  // Contiguous blocks too: adjacent blocks merge into one long run, the case a tidy cache
  // (and a fresh engine) gives, which must not be slower than a shuffled one.
  std::vector<std::uint32_t> in_order(used);
  for (std::size_t i = 0; i < used; ++i) in_order[i] = static_cast<std::uint32_t>(i);
  std::vector<std::vector<KvRun>> src_runs(shape.num_layers), dst_runs(shape.num_layers);
  std::vector<std::vector<KvRun>> flat_src_runs(shape.num_layers), flat_dst_runs(shape.num_layers);
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    if (!(*kv_src)->layout().layer_runs(l, blocks_src, src_runs[l]).is_ok() ||
        !(*kv_dst)->layout().layer_runs(l, blocks_dst, dst_runs[l]).is_ok() ||
        !(*kv_src)->layout().layer_runs(l, in_order, flat_src_runs[l]).is_ok() ||
        !(*kv_dst)->layout().layer_runs(l, in_order, flat_dst_runs[l]).is_ok()) {
      return std::cerr << "kvstash-bench kvcache --gpu: layer runs\n", 1;
    }
  }
  auto bounce = (*gpu)->allocate_host(static_cast<std::size_t>(session));
  if (!bounce.is_ok()) return std::cerr << bounce.status().to_string() << "\n", 1;
  const std::uint64_t per_layer = session / shape.num_layers;

  double d2h_s = 0, h2d_s = 0, save_s = 0, load_s = 0, gather_s = 0, scatter_s = 0;
  double flat_gather_s = 0, flat_scatter_s = 0;
  const auto staging_deadline = [] { return deadline_after(std::chrono::seconds(60)); };
  int rc = 0;
  for (std::uint32_t round = 0; round < o.rounds && rc == 0; ++round) {
    auto t0 = Clock::now();
    if (!cuda_ok(cudaMemcpy(flat_host, flat_dev, session, cudaMemcpyDeviceToHost), "D2H")) return 1;
    d2h_s += seconds_since(t0);
    t0 = Clock::now();
    if (!cuda_ok(cudaMemcpy(flat_dev, flat_host, session, cudaMemcpyHostToDevice), "H2D")) return 1;
    h2d_s += seconds_since(t0);
    t0 = Clock::now();
    for (std::uint32_t l = 0; l < shape.num_layers && rc == 0; ++l) {
      if (!(*gpu)->gather(flat_src_runs[l], bounce->get() + l * per_layer, staging_deadline()).is_ok())
        rc = 1;
    }
    flat_gather_s += seconds_since(t0);
    t0 = Clock::now();
    for (std::uint32_t l = 0; l < shape.num_layers && rc == 0; ++l) {
      if (!(*gpu)->scatter(bounce->get() + l * per_layer, flat_dst_runs[l], staging_deadline()).is_ok())
        rc = 1;
    }
    flat_scatter_s += seconds_since(t0);
    t0 = Clock::now();
    for (std::uint32_t l = 0; l < shape.num_layers && rc == 0; ++l) {
      if (!(*gpu)->gather(src_runs[l], bounce->get() + l * per_layer, staging_deadline()).is_ok()) rc = 1;
    }
    gather_s += seconds_since(t0);
    t0 = Clock::now();
    for (std::uint32_t l = 0; l < shape.num_layers && rc == 0; ++l) {
      if (!(*gpu)->scatter(bounce->get() + l * per_layer, dst_runs[l], staging_deadline()).is_ok()) rc = 1;
    }
    scatter_s += seconds_since(t0);
    rc |= time_save_and_load(**kv_src, **kv_dst, *planned, &save_s, &load_s);
  }
  std::vector<unsigned char> got(layer_bytes);
  for (std::uint32_t l = 0; l < shape.num_layers && rc == 0; ++l) {
    if (!cuda_ok(cudaMemcpy(got.data(), dst[l], layer_bytes, cudaMemcpyDeviceToHost), "read back")) return 1;
    for (std::size_t i = 0; i < used && rc == 0; ++i) {
      for (std::uint32_t p = 0; p < 2; ++p) {
        if (std::memcmp(got.data() + (p * shape.num_blocks + blocks_dst[i]) * bb,
                        host[l].data() + (p * shape.num_blocks + blocks_src[i]) * bb, bb) != 0) {
          std::cerr << "kvstash-bench kvcache --gpu: block " << i << " of layer " << l << " differs\n";
          rc = 1;
        }
      }
    }
  }
  if (rc != 0) return rc;
  const double gb = static_cast<double>(session) * o.rounds / 1e9;
  struct Row {
    const char* op;
    double gbps, ref_gbps;
    const char* ref;
  } rows[] = {{"gather", gb / gather_s, gb / d2h_s, "cudaMemcpy D2H"},
              {"scatter", gb / scatter_s, gb / h2d_s, "cudaMemcpy H2D"},
              {"gather_contiguous", gb / flat_gather_s, gb / d2h_s, "cudaMemcpy D2H"},
              {"scatter_contiguous", gb / flat_scatter_s, gb / h2d_s, "cudaMemcpy H2D"},
              {"save", gb / save_s, gb / d2h_s, "cudaMemcpy D2H"},
              {"load", gb / load_s, gb / h2d_s, "cudaMemcpy H2D"}};
  if (!o.json) {
    std::printf(
        "one Llama-2-7B session of %u tokens (%s) in GPU memory, blocks scattered, staged through pinned "
        "bounce buffers (%s by the %s device; gather and scatter: that step alone)\n",
        o.tokens, units::format_size(session).c_str(), std::string((*kv_src)->data_path()).c_str(),
        std::string((*kv_src)->device().name()).c_str());
  }
  for (const auto& r : rows) {
    if (o.json) {
      std::cout << nlohmann::json{{"transport", "gpu-staged"},
                                  {"op", r.op},
                                  {"bytes", session},
                                  {"gbps", r.gbps},
                                  {"reference", r.ref},
                                  {"reference_gbps", r.ref_gbps},
                                  {"vs_reference", r.gbps / r.ref_gbps},
                                  {"verified", true}}
                       .dump()
                << "\n";
    } else {
      std::printf("gpu-staged %-7s %8.2f GB/s   %s %8.2f GB/s   %5.2fx\n", r.op, r.gbps, r.ref, r.ref_gbps,
                  r.gbps / r.ref_gbps);
    }
  }
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    cudaFree(src[l]);
    cudaFree(dst[l]);
  }
  cudaFree(flat_dev);
  cudaFreeHost(flat_host);
  return 0;
}

}  // namespace kvstash::bench
