#include "child.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <utility>

namespace kvstash::bench {

Child::Child(const std::vector<std::string>& args) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0) return;
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]);
    close(in[1]);
    return;
  }
  std::vector<char*> argv;
  std::string self = "/proc/self/exe";
  argv.push_back(self.data());
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_ = fork();
  if (pid_ == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  to_ = fdopen(in[1], "w");
  from_ = fdopen(out[0], "r");
}

Child::~Child() {
  if (pid_ > 0) kill(pid_, SIGKILL);
  finish();
}

std::string Child::read_line() {
  char buf[16384];
  if (from_ == nullptr || std::fgets(buf, sizeof buf, from_) == nullptr) return {};
  std::string s(buf);
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

void Child::finish() {
  if (to_ != nullptr) fclose(std::exchange(to_, nullptr));
  if (from_ != nullptr) fclose(std::exchange(from_, nullptr));
  if (pid_ > 0) waitpid(std::exchange(pid_, -1), nullptr, 0);
}

}  // namespace kvstash::bench
