// kvstash explain: why a prompt missed. For keys, a prefix of token ids (its chunk keys as a
// KvCache computes them), or a request's chunk keys in a file: which are present, on which node
// and tier, and for each missing one why, from the cell's bounded record of removals
// (docs/metadata.md, "Why objects left"): never stored, evicted (when, under what pressure),
// its TTL ended, its node died, left or registered again (restarted, or fenced), its node's
// tier started over, removed, corrupt and removed. For a token prefix, also whether the keys
// of a neighbour exist: another TP rank, no salt, another model or layout.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.h"
#include "kvstash/kvcache.h"
#include "metadata/cell.h"

namespace kvstash::cli {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;

struct ExplainOptions {
  std::vector<std::string> keys;
  std::string keys_file;
  std::string tokens;  // "1,2,3" or @FILE
  PrefixKeyOptions prefix;
  std::string heads;  // "FIRST+COUNT/TOTAL": keys by heads
  std::vector<std::string> also_models, also_layouts;
};

// Why a key left, from its removal record: "<ms> <why> <detail>".
struct Gone {
  std::int64_t at_ms = 0;
  std::string why, detail;
};

std::optional<Gone> gone_of(metadata::Cell& cell, const std::string& key) {
  auto r = cell.redis().command({"HGET", cell.prefix() + ":gone:why", key});
  if (r.is_ok() && r->is_nil()) r = cell.redis().command({"HGET", cell.prefix() + ":gone:old", key});
  if (!r.is_ok() || r->is_nil()) return std::nullopt;
  std::istringstream in{std::string(r->str())};
  Gone g;
  in >> g.at_ms >> g.why;
  std::getline(in >> std::ws, g.detail);
  if (g.why.empty()) return std::nullopt;
  return g;
}

// The reason in an operator's words, `ago` after its verb.
std::string reason_text(const Gone& g, const std::string& ago) {
  const std::string& d = g.detail;
  const std::string because = d.empty() ? std::string() : ": " + d;
  if (g.why == "evicted") return "evicted " + ago + because;
  if (g.why == "expired") return "its TTL ended " + ago;
  if (g.why == "removed") return "removed " + ago + " (kvstash rm, or a client's remove)";
  if (g.why == "corrupt") return "removed as corrupt " + ago + because;
  if (g.why == "node_down") return "its node " + d + " died " + ago + " (its heartbeat ran out)";
  if (g.why == "node_left") return "its node " + d + " left the cell " + ago + " (drained or removed)";
  if (g.why == "node_restarted") {
    return "its node " + d + " registered again " + ago +
           " (restarted, paused past its deadline, or fenced by a Redis failover): its pool started over";
  }
  if (g.why == "tier_lost") {
    return "the NVMe tier of its node " + d + " started over " + ago +
           " (another device, or the node forgotten)";
  }
  return g.why + " " + ago + because;
}

Result<std::vector<std::uint32_t>> parse_tokens(std::string text) {
  if (!text.empty() && text.front() == '@') {
    std::ifstream in(text.substr(1));
    if (!in) return Status::invalid_argument("--tokens: cannot read " + text.substr(1));
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::vector<std::uint32_t> out;
  std::string cur;
  for (char c : text + ",") {
    if (c >= '0' && c <= '9') {
      cur += c;
    } else if (c == ',' || c == ' ' || c == '\n' || c == '\t' || c == '[' || c == ']') {
      if (!cur.empty()) {
        const unsigned long v = std::stoul(cur);
        if (v > 0xffffffffUL) return Status::invalid_argument("--tokens: " + cur + " is not a token id");
        out.push_back(static_cast<std::uint32_t>(v));
        cur.clear();
      }
    } else {
      return Status::invalid_argument(std::string("--tokens: unexpected '") + c +
                                      "' (token ids, comma-separated)");
    }
  }
  return out;
}

int explain(Session& s, const ExplainOptions& o) {
  struct Item {
    std::string label, key;
    std::size_t chunk = 0;
  };
  std::vector<Item> items;
  for (const auto& k : o.keys) items.push_back({k, k});
  if (!o.keys_file.empty()) {
    std::ifstream in(o.keys_file);
    if (!in) return fail(Status::invalid_argument("cannot read " + o.keys_file), "--keys-file", &s);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) items.push_back({line, line});
    }
  }
  std::vector<std::uint32_t> tokens;
  PrefixKeyOptions prefix = o.prefix;  // with --heads parsed into it
  if (!o.tokens.empty()) {
    auto t = parse_tokens(o.tokens);
    if (!t.is_ok()) return fail(t.status(), "explain", &s);
    tokens = std::move(t).value();
    if (!o.heads.empty()) {
      char plus = 0, slash = 0, rest = 0;
      auto& p = prefix;
      if (std::sscanf(o.heads.c_str(), "%u%c%u%c%u%c", &p.head_first, &plus, &p.head_count, &slash,
                      &p.heads_total, &rest) != 5 ||
          plus != '+' || slash != '/' || p.head_count == 0 || p.heads_total == 0) {
        return fail(
            Status::invalid_argument("--heads is FIRST+COUNT/TOTAL (0+1/8: the object of head 0 of 8)"),
            "explain", &s);
      }
    }
    if (prefix.model.empty() || prefix.layout_tag.empty()) {
      return fail(
          Status::invalid_argument("--tokens needs --model and --layout (the KvCache's layout tag, as "
                                   "`kvstash show` of one of its chunks prints it)"),
          "explain", &s);
    }
    const auto keys = prefix_chunk_keys(tokens, prefix);
    if (keys.empty()) {
      return fail(Status::invalid_argument("the tokens hold no full chunk of " +
                                           std::to_string(prefix.chunk_tokens) + " tokens"),
                  "explain", &s);
    }
    for (std::size_t i = 0; i < keys.size(); ++i) items.push_back({"chunk " + std::to_string(i), keys[i], i});
  }
  if (items.empty())
    return fail(Status::invalid_argument("name keys, --keys-file or --tokens"), "explain", &s);
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  metadata::Cell& c = **cell;
  // Neighbours of a token prefix: the same tokens under other parameters.
  struct Neighbour {
    std::string what;
    std::vector<std::string> keys;
  };
  std::vector<Neighbour> neighbours;
  if (!tokens.empty()) {
    auto with = [&](std::string what, auto change) {
      PrefixKeyOptions p = prefix;
      change(p);
      neighbours.push_back({std::move(what), prefix_chunk_keys(tokens, p)});
    };
    for (std::uint32_t r = 0; r < prefix.tp_size; ++r) {
      if (r != prefix.tp_rank)
        with("TP rank " + std::to_string(r), [&](PrefixKeyOptions& p) { p.tp_rank = r; });
    }
    if (prefix.tp_size > 1)
      with("no tensor parallelism", [](PrefixKeyOptions& p) { p.tp_rank = 0, p.tp_size = 1; });
    if (!prefix.extra.empty()) with("no salt", [](PrefixKeyOptions& p) { p.extra.clear(); });
    for (const auto& m : o.also_models) with("model " + m, [&](PrefixKeyOptions& p) { p.model = m; });
    for (const auto& l : o.also_layouts) with("layout " + l, [&](PrefixKeyOptions& p) { p.layout_tag = l; });
  }
  auto present = [&](const std::string& key) { return c.catalog().stat(key); };
  std::int64_t now = 0;  // Redis's clock, which the removal records use
  if (auto clock = c.admin().describe({}, &now); !clock.is_ok())
    return fail(clock.status(), "reading the cell", &s);
  std::string redis_age;
  if (auto info = c.redis().command({"INFO", "server"}); info.is_ok()) {
    const std::string text(info->str());
    const auto at = text.find("uptime_in_seconds:");
    if (at != std::string::npos) {
      redis_age = format_duration(milliseconds(std::stoll(text.substr(at + 18)) * 1000));
    }
  }
  json out = json::array();
  Table t({"WHAT", "KEY", "STATE", "WHY"});
  std::size_t missing = 0;
  for (const Item& it : items) {
    json j{{"what", it.label}, {"key", it.key}};
    auto rec = present(it.key);
    if (rec.is_ok()) {
      const std::string node = rec->nodes.empty() ? std::string("?") : rec->nodes.front();
      const std::string tier = rec->tier == "ssd" ? "nvme" : "dram";
      j.update({{"present", true}, {"node", node}, {"tier", tier}});
      t.row({it.label, it.key, "present", "on " + node + " (" + tier + ")"});
      out.push_back(j);
      continue;
    }
    if (rec.status().code() != StatusCode::kNotFound) return fail(rec.status(), "explain " + it.key, &s);
    ++missing;
    std::string why;
    j["present"] = false;
    if (auto g = gone_of(c, it.key)) {
      why =
          reason_text(*g, format_duration(milliseconds(std::max<std::int64_t>(0, now - g->at_ms))) + " ago");
      j.update({{"reason", g->why},
                {"detail", g->detail},
                {"since_ms", std::max<std::int64_t>(0, now - g->at_ms)}});
    } else {
      why =
          "never stored in this cell (its record keeps the last 50,000 removals at least; its Redis has run "
          "for " +
          (redis_age.empty() ? std::string("?") : redis_age) + ")";
      j["reason"] = "never_stored";
    }
    json near = json::array();
    for (const Neighbour& n : neighbours) {
      if (it.key.rfind("kvp:", 0) != 0 || it.chunk >= n.keys.size()) continue;
      if (present(n.keys[it.chunk]).is_ok()) {
        near.push_back(n.what);
        why += "; a key for " + n.what + " exists";
      }
    }
    if (!near.empty()) j["neighbours"] = near;
    t.row({it.label, it.key, "missing", why});
    out.push_back(j);
  }
  if (s.json()) {
    std::cout << out.dump(2) << "\n";
  } else {
    std::cout << t.str();
    std::cout << (items.size() - missing) << " of " << items.size() << " present\n";
  }
  return kExitOk;
}

}  // namespace

void add_explain_command(Registry& r) {
  Session& s = r.session;
  auto o = std::make_shared<ExplainOptions>();
  auto* ex = r.app.add_subcommand(
      "explain",
      "Why a key or a prompt's chunks missed: present where, or why gone (evicted, TTL, node, corrupt, ...)");
  ex->add_option("KEY", o->keys, "Object keys");
  ex->add_option("--keys-file", o->keys_file, "A file of keys, one per line (a request's chunk keys)");
  ex->add_option("--tokens", o->tokens,
                 "Token ids (comma-separated, or @FILE): their chunk keys are explained");
  ex->add_option("--model", o->prefix.model,
                 "With --tokens: the model's identity as the KvCache was given it");
  ex->add_option("--layout", o->prefix.layout_tag,
                 "With --tokens: the KvCache's layout tag (`kvstash show CHUNK`)");
  ex->add_option("--salt", o->prefix.extra,
                 "With --tokens: the keys' extra salt (vLLM: salt and cache_salt)");
  ex->add_option("--tp-rank", o->prefix.tp_rank, "With --tokens: the tensor-parallel rank")
      ->capture_default_str();
  ex->add_option("--tp-size", o->prefix.tp_size, "With --tokens: the tensor-parallel size")
      ->capture_default_str();
  ex->add_option("--heads", o->heads,
                 "With --tokens: keys by heads, FIRST+COUNT/TOTAL (the end of a chunk key: h0+1/8)");
  ex->add_option(
      "--group", o->prefix.group,
      "With --tokens: a hybrid model's KV-cache group, as the vLLM connector logs it (swa128.1f2e3d4c)");
  ex->add_option("--chunk-tokens", o->prefix.chunk_tokens, "With --tokens: tokens per chunk")
      ->capture_default_str();
  ex->add_option("--also-model", o->also_models,
                 "With --tokens: another model whose keys to look for (repeatable)");
  ex->add_option("--also-layout", o->also_layouts,
                 "With --tokens: another layout tag to look for (repeatable)");
  ex->footer(
      "Examples:\n"
      "  kvstash explain session:42\n"
      "  kvstash explain --tokens @prompt.ids --model llama-3-8b@main --layout L32.P2.H8.D128.B16.bf16.nhd "
      "--chunk-tokens 256 --tp-size 2\n"
      "  kvstash explain --keys-file request.keys --json");
  ex->final_callback([&r, &s, o] { r.action = [&s, o] { return explain(s, *o); }; });
}

}  // namespace kvstash::cli
