// kvstash: the operator's command line for a kvstash cell (docs/cli.md). Every subcommand is
// built on the store and metadata classes; this file holds the global options, `bench`
// (forwarded to kvstash-bench), `completion`, and the exit codes.
#include <limits.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>

#include "cli.h"
#include "kvstash/store.h"
#include "metadata/redis_client.h"

namespace {

using namespace kvstash;
using namespace kvstash::cli;

// kvstash-bench: $KVSTASH_BENCH, next to this binary (installed), in the build tree
// (build/tools/kvstash -> build/bench), else on PATH.
std::string find_bench() {
  if (const char* env = std::getenv("KVSTASH_BENCH"); env != nullptr) return env;
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    const std::filesystem::path dir = std::filesystem::path(self).parent_path();
    for (const auto& p : {dir / "kvstash-bench", dir / ".." / ".." / "bench" / "kvstash-bench"}) {
      if (access(p.c_str(), X_OK) == 0) return p.string();
    }
  }
  return "kvstash-bench";
}

// Where `bench` stands on the command line (after global options only), or 0.
int bench_word(int argc, char** argv) {
  static const std::vector<std::string_view> with_value{"--redis", "--redis-password-file",
                                                        "--cluster-token-file", "--cell", "--timeout"};
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "bench") return i;
    if (a == "--json") continue;
    if (std::ranges::find(with_value, a) != with_value.end()) {
      ++i;
      continue;
    }
    if (a.starts_with("--") && a.find('=') != std::string_view::npos) continue;
    return 0;
  }
  return 0;
}

// Replaces this process with kvstash-bench and `args`; returns only when it cannot.
int forward_bench(int argc, char** args) {
  const std::string exe = find_bench();
  std::vector<char*> argv2{const_cast<char*>(exe.c_str())};
  for (int i = 0; i < argc; ++i) argv2.push_back(args[i]);
  argv2.push_back(nullptr);
  execvp(exe.c_str(), argv2.data());
  return fail(Status::from_errno("cannot run " + exe + " (set KVSTASH_BENCH to its path)", errno), "bench");
}

// Options of `app` as words, for completion.
std::string option_words(const CLI::App* app) {
  std::string words;
  for (const CLI::Option* o : app->get_options()) {
    for (const auto& l : o->get_lnames()) words += " --" + l;
    for (const auto& s : o->get_snames()) words += " -" + s;
  }
  return words;
}

// A bash completion script generated from the command tree, so it never falls behind it.
std::string bash_completion(const CLI::App& app) {
  std::map<std::string, std::string> words;  // "sub path" -> candidate words
  std::function<void(const CLI::App*, const std::string&)> walk = [&](const CLI::App* a,
                                                                      const std::string& path) {
    std::string w = option_words(a);
    for (const CLI::App* sub : a->get_subcommands([](const CLI::App*) { return true; })) {
      w += " " + sub->get_name();
      walk(sub, path.empty() ? sub->get_name() : path + " " + sub->get_name());
    }
    words[path] = w;
  };
  walk(&app, "");
  std::string s =
      "# bash completion for kvstash: source <(kvstash completion bash)\n"
      "_kvstash() {\n"
      "  local cur=${COMP_WORDS[COMP_CWORD]} path= w i\n"
      "  for ((i = 1; i < COMP_CWORD; i++)); do\n"
      "    w=${COMP_WORDS[i]}\n"
      "    [[ $w == -* ]] && continue\n"
      "    case \"${path:+$path }$w\" in\n";
  for (const auto& [path, _] : words) {
    if (!path.empty()) s += "      \"" + path + "\") path=\"" + path + "\" ;;\n";
  }
  s += "    esac\n  done\n  case \"$path\" in\n";
  for (const auto& [path, w] : words) s += "    \"" + path + "\") w=\"" + w + "\" ;;\n";
  s += "  esac\n"
       "  COMPREPLY=($(compgen -W \"$w\" -- \"$cur\"))\n"
       "  [[ $cur != -* && ${#COMPREPLY[@]} -eq 0 ]] && COMPREPLY=($(compgen -f -- \"$cur\"))\n"
       "}\n"
       "complete -F _kvstash kvstash\n";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvstash: run a kvstash cell (memory nodes holding KV cache, metadata in Redis): its status, "
      "nodes and objects, eviction and drains, checks of this host, and KV-cache capacity planning."};
  app.footer(
      "Examples:\n"
      "  kvstash status\n"
      "  kvstash ls 'kvp:*' --sort size --limit 20\n"
      "  kvstash drain node-7 --wait --timeout 10m\n"
      "  kvstash plan --model llama-2-7b --context 4096 --remote-mem 1TiB\n"
      "  kvstash doctor\n\n"
      "Environment: KVSTASH_REDIS_URL, KVSTASH_REDIS_PASSWORD, KVSTASH_CLUSTER_TOKEN, KVSTASH_CELL, "
      "KVSTASH_LOG.\n"
      "Exit codes: 0 ok, 1 error, 2 usage (bad arguments), 3 not found. docs/cli.md has the details.");
  app.require_subcommand(1);
  app.fallthrough();  // global options also after the subcommand

  Globals g;
  app.add_option("--redis", g.redis_url,
                 "The cell's Redis: redis://[user:password@]host:port/db, unix://[user:password@]/path, "
                 "redis+sentinel://[user:password@]sentinel[:port],.../service[/db] or "
                 "redis+cluster://[user:password@]node[:port],...; rediss://... (and rediss+sentinel, rediss+cluster) for TLS, "
                 "with ?ca=FILE&cert=FILE&key=FILE&sni=NAME; ?redirect=HOST[:PORT],... for the servers a sentinel may name")
      ->envname("KVSTASH_REDIS_URL")
      ->capture_default_str();
  app.add_option("--redis-password-file", g.password_file,
                 "File holding the Redis password (else KVSTASH_REDIS_PASSWORD, else the URL's)");
  app.add_option("--cluster-token-file", g.token_file,
                 "File holding the cell's cluster token, which get, put and drain --move prove to the memory "
                 "nodes (else KVSTASH_CLUSTER_TOKEN); refused when group or others may read or write it "
                 "(chmod 600) or when it is empty")
      ->each([&g](const std::string&) { g.token_file_given = true; });
  app.add_option(
         "--cell", g.cell,
         "Cell name (key prefix kvs:{kvs:<cell>}); `all`: status, ls, doctor and get over every cell the "
         "cell directory lists (`kvstash cells`)")
      ->envname("KVSTASH_CELL")
      ->capture_default_str();
  app.add_flag("--json", g.json, "Machine-readable output: one JSON document on stdout");
  app.add_option("--timeout", g.timeout, "Deadline of each operation (e.g. 500ms, 10s, 2m)")
      ->capture_default_str();

  Session session(g);
  Action action;
  Registry reg{app, session, action};
  add_cluster_commands(reg);
  add_object_commands(reg);
  add_doctor_command(reg);
  add_plan_command(reg);
  add_cells_command(reg);
  add_quota_commands(reg);
  add_explain_command(reg);
  add_events_command(reg);

  // `bench` hands everything after it to kvstash-bench untouched (see forward_bench); it is
  // declared here for --help and completion.
  auto* bench =
      app.add_subcommand("bench", "Run kvstash-bench with the arguments that follow (kvstash bench --help)");
  bench->footer(
      "Examples:\n  kvstash bench store --object-size 64MiB\n  kvstash bench kvcache\n"
      "  kvstash bench p2p --transport tcp");

  auto* completion = app.add_subcommand("completion", "Print a shell completion script");
  std::string shell;
  completion->add_option("shell", shell, "bash")->required()->check(CLI::IsMember({"bash"}));
  completion->footer(
      "Examples:\n  source <(kvstash completion bash)\n"
      "  kvstash completion bash > /etc/bash_completion.d/kvstash");
  completion->final_callback([&] {
    action = [&] {
      std::cout << bash_completion(app);
      return kExitOk;
    };
  });

  if (int at = bench_word(argc, argv); at > 0) return forward_bench(argc - at - 1, argv + at + 1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  if (!action) return kExitUsage;
  // A password in a URL typed on the command line is every local user's to read.
  if (auto url = metadata::RedisUrl::parse(g.redis_url); url.is_ok() && !url->password.empty()) {
    for (int i = 1; i < argc; ++i) {
      if (std::string_view(argv[i]).find(g.redis_url) != std::string_view::npos) {
        std::cerr << "kvstash: warning: the --redis URL holds a password, which `ps` shows to every user of this "
                     "host: use --redis-password-file or KVSTASH_REDIS_PASSWORD\n";
        break;
      }
    }
  }
  return action();
}
