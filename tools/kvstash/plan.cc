// kvstash plan: the KV-cache arithmetic. Bytes per token = 2 (K and V) x layers x KV heads x
// head dim x bytes per element; what fits next to the weights on a GPU; how many more
// sequences remote memory keeps warm.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "cli.h"
#include "common/units.h"
#include "tools/kvstash/replay_model.h"

namespace kvstash::cli {
namespace {

using nlohmann::json;

struct Model {
  const char* name;
  std::uint32_t layers, kv_heads, head_dim;
  double params_billion;
  const char* note;
};

// Published configurations (config.json of each model): layers, KV heads (GQA), head dim.
constexpr Model kModels[] = {
    {"llama-2-7b", 32, 32, 128, 6.74, "MHA"},        {"llama-2-13b", 40, 40, 128, 13.02, "MHA"},
    {"llama-2-70b", 80, 8, 128, 68.98, "GQA"},       {"llama-3-8b", 32, 8, 128, 8.03, "GQA"},
    {"llama-3-70b", 80, 8, 128, 70.55, "GQA"},       {"mistral-7b", 32, 8, 128, 7.24, "GQA"},
    {"mixtral-8x7b", 32, 8, 128, 46.70, "GQA, MoE"}, {"qwen2-7b", 28, 4, 128, 7.62, "GQA"},
    {"qwen2.5-14b", 48, 8, 128, 14.77, "GQA"},       {"qwen2.5-72b", 80, 8, 128, 72.71, "GQA"},
};

struct PlanOptions {
  std::string model = "llama-2-7b";
  std::uint32_t context = 4096, batch = 0, layers = 0, kv_heads = 0, head_dim = 0;
  double params_billion = 0;
  std::string gpu_mem = "80GB", kv_dtype = "fp16", weight_dtype = "fp16", remote_mem = "0", nvme_mem = "0";
  // What a restore and a recompute cost: the data path from remote DRAM (GB/s), an NVMe
  // tier's read (GB/s, before that same transfer), and the engine's prefill (tokens/s; 0: not
  // compared).
  double restore_gbps = 10, nvme_gbps = 3, prefill_tps = 0;
  bool list = false;
  // --trace: the DRAM and NVMe a trace's traffic needs for a token hit rate (0: 95% of what an
  // unlimited cache gets), from its replay through the model (LRU, as the connectors save).
  std::string trace;
  double hit_rate = 0;
  std::uint32_t block_tokens = 512;
};

double dtype_bytes(const std::string& d) {
  if (d == "fp32") return 4;
  if (d == "fp16" || d == "bf16") return 2;
  if (d == "fp8" || d == "int8") return 1;
  if (d == "int4") return 0.5;
  return 0;
}

std::string grouped(std::uint64_t v) {  // 524288 -> "524,288"
  const std::string digits = std::to_string(v);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

int list_models(Session& s) {
  if (s.json()) {
    json j = json::array();
    for (const Model& m : kModels) {
      j.push_back({{"model", m.name},
                   {"layers", m.layers},
                   {"kv_heads", m.kv_heads},
                   {"head_dim", m.head_dim},
                   {"params_billion", m.params_billion}});
    }
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  Table t({"MODEL", "LAYERS", "KV HEADS", "HEAD DIM", "PARAMS", "ATTENTION", "FP16 KV/TOKEN"});
  for (const Model& m : kModels) {
    char p[16];
    std::snprintf(p, sizeof p, "%.2fB", m.params_billion);
    t.row({m.name, std::to_string(m.layers), std::to_string(m.kv_heads), std::to_string(m.head_dim), p,
           m.note, units::format_size(2ull * m.layers * m.kv_heads * m.head_dim * 2)});
  }
  std::cout << t.str();
  return kExitOk;
}

// The smallest capacity in [lo, hi] blocks whose hit rate `hit_at` reaches `target` (LRU's hit
// rate grows with its capacity: a bisection), or nullopt when even hi does not.
std::optional<std::uint64_t> smallest(std::uint64_t lo, std::uint64_t hi, double target,
                                      const std::function<double(std::uint64_t)>& hit_at) {
  if (hit_at(hi) < target) return std::nullopt;
  while (lo < hi) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    if (hit_at(mid) >= target) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// kvstash plan --trace: per layout (DRAM alone; DRAM of a share of that over an NVMe tier), the
// capacity that reaches the hit rate, in blocks and in bytes of this model's KV cache.
int plan_trace(Session& s, const PlanOptions& o, std::uint64_t bytes_per_token) {
  auto trace = replay::read_trace(o.trace);
  if (!trace.is_ok()) return fail(trace.status(), "plan --trace", &s);
  if (trace->empty())
    return fail(Status::invalid_argument("trace " + o.trace + " has no request"), "plan", &s);
  std::set<std::uint64_t> distinct;
  for (const auto& r : *trace) distinct.insert(r.blocks.begin(), r.blocks.end());
  const std::uint64_t all = distinct.size();
  const double hours = static_cast<double>(trace->back().at_ms - trace->front().at_ms) / 3.6e6;
  auto lru = [&](std::uint64_t blocks) {
    return replay::replay_model(*trace, blocks, replay::ReplayPolicy::kLru, o.block_tokens,
                                replay::ReplaySaves::kConnector)
        .hit_rate();
  };
  const double ceiling = lru(all);
  const double target = o.hit_rate > 0 ? o.hit_rate : 0.95 * ceiling;
  const std::uint64_t block_bytes = bytes_per_token * o.block_tokens;
  struct Layout {
    std::string name;
    std::uint64_t dram = 0, nvme = 0, promoted = 0;
    double hit = 0;
    bool reached = false;
  };
  std::vector<Layout> layouts;
  const auto dram_alone = smallest(1, all, target, lru);
  layouts.push_back(
      {.name = "DRAM alone", .dram = dram_alone.value_or(0), .reached = dram_alone.has_value()});
  if (dram_alone) {
    layouts.back().hit = lru(*dram_alone);
    for (std::uint64_t share : {2, 4, 10}) {
      const std::uint64_t dram = std::max<std::uint64_t>(1, *dram_alone / share);
      auto tiered = [&](std::uint64_t nvme) {
        return replay::replay_tiers(*trace, dram, nvme, o.block_tokens).total.hit_rate();
      };
      const auto nvme = smallest(0, all, target, tiered);
      Layout l{
          .name = "DRAM 1/" + std::to_string(share) + " + NVMe", .dram = dram, .reached = nvme.has_value()};
      if (nvme) {
        const replay::TierResult t = replay::replay_tiers(*trace, dram, *nvme, o.block_tokens);
        l.nvme = *nvme;
        l.hit = t.total.hit_rate();
        l.promoted = t.tier_hit_blocks;
      }
      layouts.push_back(l);
    }
  }
  if (s.json()) {
    json j{{"trace", o.trace},
           {"requests", trace->size()},
           {"hours", hours},
           {"distinct_blocks", all},
           {"block_tokens", o.block_tokens},
           {"block_bytes", block_bytes},
           {"unlimited_hit_rate", ceiling},
           {"target_hit_rate", target},
           {"layouts", json::array()}};
    for (const auto& l : layouts) {
      j["layouts"].push_back(
          {{"layout", l.name},
           {"reached", l.reached},
           {"dram_blocks", l.dram},
           {"dram_bytes", l.dram * block_bytes},
           {"nvme_blocks", l.nvme},
           {"nvme_bytes", l.nvme * block_bytes},
           {"hit_rate", l.hit},
           {"promoted_blocks_per_s", hours > 0 ? static_cast<double>(l.promoted) / (hours * 3600) : 0}});
    }
    std::cout << j.dump(2) << "\n";
    return target > ceiling ? kExitError : kExitOk;
  }
  std::printf("trace          %s: %zu requests over %.2f h, %s distinct blocks of %u tokens (%s each here)\n",
              o.trace.c_str(), trace->size(), hours, grouped(all).c_str(), o.block_tokens,
              units::format_size(block_bytes).c_str());
  std::printf(
      "hit rate       %.4f of prompt tokens wanted; an unlimited cache finds %.4f (LRU, as the connectors "
      "save)\n",
      target, ceiling);
  if (!dram_alone) {
    std::printf("               not reachable: no capacity finds more than %.4f of this trace's tokens\n",
                ceiling);
    return kExitError;
  }
  Table t({"LAYOUT", "DRAM", "NVME", "HIT RATE", "PROMOTED/S"});
  for (const auto& l : layouts) {
    if (!l.reached) {
      t.row({l.name, units::format_size(l.dram * block_bytes), "not reachable", "", ""});
      continue;
    }
    char hit[16], promoted[32];
    std::snprintf(hit, sizeof hit, "%.4f", l.hit);
    std::snprintf(promoted, sizeof promoted, "%.1f",
                  hours > 0 ? static_cast<double>(l.promoted) / (hours * 3600) : 0.0);
    t.row({l.name, units::format_size(l.dram * block_bytes) + " (" + grouped(l.dram) + ")",
           l.nvme ? units::format_size(l.nvme * block_bytes) + " (" + grouped(l.nvme) + ")" : "-", hit,
           l.nvme ? promoted : "-"});
  }
  std::cout << t.str();
  std::cout
      << "(capacities in bytes of this model's KV cache, blocks in brackets; the model of the cell: LRU "
         "in DRAM and on the tier, a block DRAM gives up written down, a hit on the tier promoted; "
         "kvstash-bench replay measures a cell)\n";
  return kExitOk;
}

int plan(Session& s, const PlanOptions& o) {
  if (o.list) return list_models(s);
  Model m{"custom", o.layers, o.kv_heads, o.head_dim, o.params_billion, ""};
  if (o.model != "custom") {
    const Model* preset = nullptr;
    for (const Model& p : kModels) {
      if (o.model == p.name) preset = &p;
    }
    if (preset == nullptr) {
      return fail(
          Status::invalid_argument("unknown model '" + o.model +
                                   "': `kvstash plan --list-models` lists the presets; --model custom "
                                   "with --layers, --kv-heads, --head-dim and --params for others"),
          "plan", &s);
    }
    m = *preset;
    if (o.layers > 0) m.layers = o.layers;
    if (o.kv_heads > 0) m.kv_heads = o.kv_heads;
    if (o.head_dim > 0) m.head_dim = o.head_dim;
    if (o.params_billion > 0) m.params_billion = o.params_billion;
  }
  if (m.layers == 0 || m.kv_heads == 0 || m.head_dim == 0) {
    return fail(Status::invalid_argument("--model custom needs --layers, --kv-heads and --head-dim"), "plan",
                &s);
  }
  const double kv_bytes = dtype_bytes(o.kv_dtype), w_bytes = dtype_bytes(o.weight_dtype);
  auto gpu = units::parse_size(o.gpu_mem);
  auto remote = units::parse_size(o.remote_mem);
  if (!gpu.is_ok()) return fail(gpu.status(), "plan --gpu-mem", &s);
  if (!remote.is_ok()) return fail(remote.status(), "plan --remote-mem", &s);
  auto nvme = units::parse_size(o.nvme_mem);
  if (!nvme.is_ok()) return fail(nvme.status(), "plan --nvme-mem", &s);
  if (o.restore_gbps <= 0 || o.nvme_gbps <= 0 || o.prefill_tps < 0) {
    return fail(
        Status::invalid_argument("--restore-gbps and --nvme-gbps must be positive, --prefill-tps at least 0"),
        "plan", &s);
  }

  const auto bytes_per_token =
      static_cast<std::uint64_t>(2.0 * m.layers * m.kv_heads * m.head_dim * kv_bytes);
  if (!o.trace.empty()) return plan_trace(s, o, bytes_per_token);
  const std::uint64_t bytes_per_sequence = bytes_per_token * o.context;
  const double weights = m.params_billion * 1e9 * w_bytes;
  const double budget = std::max(0.0, static_cast<double>(*gpu) - weights);
  const auto max_sequences =
      static_cast<std::uint64_t>(std::floor(budget / static_cast<double>(bytes_per_sequence)));
  const std::uint64_t remote_sequences = *remote / bytes_per_sequence;
  const std::uint64_t waiting = o.batch > max_sequences ? o.batch - max_sequences : 0;
  // DRAM and NVMe together: the tier keeps what the pools do not; a sequence restored from it
  // is read from the NVMe into its node's pool first, then moves as any other.
  const std::uint64_t nvme_sequences = *nvme / bytes_per_sequence;
  const double seq_gb = static_cast<double>(bytes_per_sequence) / 1e9;
  const double restore_s = seq_gb / o.restore_gbps;
  const double nvme_restore_s = seq_gb / o.nvme_gbps + restore_s;
  const double recompute_s = o.prefill_tps > 0 ? static_cast<double>(o.context) / o.prefill_tps : 0;

  if (s.json()) {
    json j{{"model", m.name},
           {"layers", m.layers},
           {"kv_heads", m.kv_heads},
           {"head_dim", m.head_dim},
           {"kv_dtype", o.kv_dtype},
           {"context_tokens", o.context},
           {"bytes_per_token", bytes_per_token},
           {"bytes_per_sequence", bytes_per_sequence},
           {"gpu_bytes", *gpu},
           {"weights_bytes", static_cast<std::uint64_t>(weights)},
           {"kv_budget_bytes", static_cast<std::uint64_t>(budget)},
           {"max_sequences", max_sequences},
           {"remote_bytes", *remote},
           {"remote_sequences", remote_sequences},
           {"nvme_bytes", *nvme},
           {"nvme_sequences", nvme_sequences},
           {"restore_seconds", restore_s},
           {"nvme_restore_seconds", nvme_restore_s}};
    if (o.prefill_tps > 0) j["recompute_seconds"] = recompute_s;
    if (o.batch > 0) {
      j["batch"] = o.batch;
      j["batch_fits"] = waiting == 0;
      j["batch_waiting_sequences"] = waiting;
    }
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  char params[32];
  std::snprintf(params, sizeof params, "%.2fB", m.params_billion);
  std::cout << "model          " << m.name << ": " << m.layers << " layers, " << m.kv_heads << " KV heads x "
            << m.head_dim << ", " << params << " parameters (" << format_gb(weights) << " in "
            << o.weight_dtype << ")\n";
  std::cout << "per token      2 x " << m.layers << " layers x " << m.kv_heads << " KV heads x " << m.head_dim
            << " x " << kv_bytes << " bytes (" << o.kv_dtype << ") = " << grouped(bytes_per_token)
            << " bytes (" << units::format_size(bytes_per_token) << ")\n";
  std::cout << "per sequence   " << grouped(o.context)
            << " tokens = " << format_gb(static_cast<double>(bytes_per_sequence)) << " ("
            << units::format_size(bytes_per_sequence) << ")\n";
  std::cout << "GPU            " << format_gb(static_cast<double>(*gpu)) << " - " << format_gb(weights)
            << " of weights = " << format_gb(budget) << " for KV cache: " << max_sequences << " sequences of "
            << grouped(o.context) << " tokens\n";
  if (o.batch > 0) {
    std::cout << "batch " << o.batch << (waiting == 0 ? " fits" : "");
    if (waiting > 0) {
      std::cout << ": " << waiting << " sequences wait off the GPU ("
                << format_gb(static_cast<double>(waiting * bytes_per_sequence)) << " of KV cache to offload)";
    }
    std::cout << "\n";
  }
  auto secs = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, v < 0.01 ? "%.4f s" : "%.2f s", v);
    return std::string(b);
  };
  if (*remote > 0) {
    std::cout << "remote memory  " << units::format_size(*remote) << " keeps " << remote_sequences
              << " more sequences warm (restored instead of recomputed): " << secs(restore_s) << " each at "
              << o.restore_gbps << " GB/s\n";
  }
  if (*nvme > 0) {
    std::cout << "nvme tier      " << units::format_size(*nvme) << " keeps " << nvme_sequences
              << " more behind them: " << secs(nvme_restore_s) << " each (" << secs(seq_gb / o.nvme_gbps)
              << " from the NVMe at " << o.nvme_gbps << " GB/s, then the transfer)\n";
  }
  if (o.prefill_tps > 0) {
    std::cout << "recompute      " << grouped(o.context) << " tokens at " << o.prefill_tps
              << " tokens/s = " << secs(recompute_s);
    if (*remote > 0 || *nvme > 0) {
      std::cout << ": a restore from DRAM is " << (restore_s < recompute_s ? "faster" : "slower");
      if (*nvme > 0) std::cout << ", from the NVMe " << (nvme_restore_s < recompute_s ? "faster" : "slower");
      if (*nvme > 0 && nvme_restore_s >= recompute_s) {
        std::cout << " (recompute those: Store::prefix_tiers, GetOptions::promote = false)";
      }
    }
    std::cout << "\n";
  }
  return kExitOk;
}

}  // namespace

void add_plan_command(Registry& r) {
  Session& s = r.session;
  auto o = std::make_shared<PlanOptions>();
  auto* p = r.app.add_subcommand(
      "plan",
      "KV-cache capacity planning: bytes per token and sequence, what fits on a GPU and in remote memory");
  p->add_option("--model", o->model, "A preset (--list-models) or custom")->capture_default_str();
  p->add_option("--context", o->context, "Tokens per sequence")
      ->capture_default_str()
      ->check(CLI::Range(1u, 100'000'000u));
  p->add_option("--batch", o->batch, "Sequences you want resident at once");
  p->add_option("--gpu-mem", o->gpu_mem, "GPU memory (80GB, 141GB, 80GiB)")->capture_default_str();
  p->add_option("--kv-dtype", o->kv_dtype, "KV-cache element type")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "fp16", "bf16", "fp8", "int8"}));
  p->add_option("--weight-dtype", o->weight_dtype, "Weight element type")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "fp16", "bf16", "fp8", "int8", "int4"}));
  p->add_option("--kv-heads", o->kv_heads, "Override the model's KV heads (GQA)");
  p->add_option("--layers", o->layers, "Layers (custom models, or an override)");
  p->add_option("--head-dim", o->head_dim, "Head dimension (custom models, or an override)");
  p->add_option("--params", o->params_billion, "Parameters in billions (custom models, or an override)");
  p->add_option("--remote-mem", o->remote_mem, "Remote memory for offloaded sequences (1TiB)")
      ->capture_default_str();
  p->add_option("--nvme-mem", o->nvme_mem, "The memory nodes' NVMe tiers, behind their DRAM (kvstashd --ssd)")
      ->capture_default_str();
  p->add_option("--restore-gbps", o->restore_gbps, "The data path from remote memory, GB/s (100 Gb/s: 12.5)")
      ->capture_default_str();
  p->add_option("--nvme-gbps", o->nvme_gbps, "An NVMe tier's read, GB/s")->capture_default_str();
  p->add_option("--prefill-tps", o->prefill_tps,
                "The engine's prefill, tokens/s: compares a restore with a recompute (0: not compared)")
      ->capture_default_str();
  p->add_flag("--list-models", o->list, "List the presets");
  p->add_option(
      "--trace", o->trace,
      "A trace of requests (kvstash-bench replay's format): the DRAM, and DRAM over NVMe, its traffic "
      "needs for --hit-rate, from a replay through the model");
  p->add_option("--hit-rate", o->hit_rate,
                "--trace: the share of prompt tokens to find (0: 95% of what an unlimited cache finds)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  p->add_option("--block-tokens", o->block_tokens, "--trace: tokens per block of the trace")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  p->footer(
      "Examples:\n"
      "  kvstash plan --model llama-2-7b --context 4096\n"
      "  kvstash plan --model llama-2-7b --kv-heads 8 --kv-dtype int8\n"
      "  kvstash plan --model llama-3-70b --gpu-mem 141GB --batch 64 --remote-mem 2TiB\n"
      "  kvstash plan --model llama-3-8b --remote-mem 512GiB --nvme-mem 8TiB --prefill-tps 12000\n"
      "  kvstash plan --model custom --layers 40 --kv-heads 8 --head-dim 128 --params 20 --json\n"
      "  kvstash plan --model llama-3-8b --trace conversations.jsonl --hit-rate 0.3");
  p->final_callback([&r, &s, o] { r.action = [&s, o] { return plan(s, *o); }; });
}

}  // namespace kvstash::cli
