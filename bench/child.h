// A child process of kvstash-bench with pipes to its stdin and stdout: the benchmark's
// target side. Killed (SIGKILL) and reaped on destruction if still running.
#pragma once

#include <sys/types.h>

#include <cstdio>
#include <string>
#include <vector>

namespace kvstash::bench {

class Child {
 public:
  // Runs this executable (/proc/self/exe) with `args`.
  explicit Child(const std::vector<std::string>& args);
  ~Child();
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  // One line of the child's stdout without the newline; empty at EOF.
  std::string read_line();
  // Closes the child's stdin (it exits on EOF) and reaps it.
  void finish();

 private:
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

}  // namespace kvstash::bench
