// Running a tool under test as a process: its output and exit status.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvstash::test {

// Runs `cmd` through the shell; returns its stdout and sets `*status` (pclose's).
inline std::string run(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  *status = pclose(p);
  return out;
}

// kvstash-bench, as meson test names it in KVSTASH_BENCH; empty when run by hand.
inline std::string bench() {
  const char* exe = std::getenv("KVSTASH_BENCH");
  return exe ? exe : "";
}

}  // namespace kvstash::test
