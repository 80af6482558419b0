// tests/harness/child_process.h: a child process the tests and kvstash-bench start and own: argv and
// environment without a shell, stdout piped to the parent line by line, its own process group,
// killed with its parent (PR_SET_PDEATHSIG) and reaped by the destructor.
//
// Thread safety: a ChildProcess is used by one thread at a time; start children from a thread
// that outlives them (the kernel delivers PR_SET_PDEATHSIG when the starting *thread* exits).
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash::harness {

struct ChildOptions {
  // argv[0] is run through execvp: looked up in PATH unless it contains a '/'.
  std::vector<std::string> argv;
  // Set in the child's environment, on top of (or replacing) this process's. Secrets such as
  // KVSTASH_REDIS_PASSWORD travel here rather than on the command line, where `ps` shows them.
  std::vector<std::pair<std::string, std::string>> env;
  // Removed from the child's environment (unless `env` sets them).
  std::vector<std::string> unset_env;
  // stdout goes into a pipe that read_line() reads (true), or to /dev/null (false). A child
  // that writes much to a pipe nobody reads blocks once the pipe is full (64 KiB): capture
  // only what the caller reads.
  bool capture_stdout = true;
  // stderr is inherited (the user sees the child's errors) unless this is set.
  bool discard_stderr = false;
  // Run in a process group of its own, so that the terminal's Ctrl-C (SIGINT to the
  // foreground group) reaches only us and we stop the child in order. It still dies with us.
  bool own_process_group = true;
};

// A child process with its stdout piped to us. stdin is /dev/null; the child inherits no
// other descriptor of ours (everything above stderr is closed before exec). Move-only; the
// destructor SIGKILLs and reaps a child still running.
class ChildProcess {
 public:
  // Forks and execs. Errors: kInvalidArgument (empty argv), kNotFound (no such program),
  // kPermissionDenied (not executable), kIoError (fork, pipe). Does not wait for anything
  // but the exec.
  static Result<ChildProcess> start(const ChildOptions& options);

  ChildProcess() = default;
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  // -1 once reaped (or for a default-constructed object).
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }

  // One line of the child's stdout without its newline. Blocks until a whole line arrived,
  // the deadline passed, or the child closed its stdout: nullopt for the last two (eof()
  // tells which; a last line without a newline is returned before EOF is reported).
  std::optional<std::string> read_line(Deadline deadline);
  bool eof() const { return eof_; }

  // Sends `sig` to the child (nothing once it is reaped).
  void signal(int sig);

  // Reaps the child: its exit status, or 128 + the signal that killed it (the shell's
  // convention). nullopt when it is still running at the deadline. Once reaped, returns the
  // same status again.
  std::optional<int> wait(Deadline deadline);

  // SIGKILL and reap; returns the status as wait() does. No-op once reaped.
  int kill();

 private:
  void reset();

  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  bool eof_ = false;
  std::string pending_;  // read from the pipe, not yet returned as a line
  std::optional<int> status_;
};

// "exited with status 3", "was killed by signal 9 (Killed)": how a child ended, from the
// status wait() returns (128 + the signal for a signal).
std::string describe_status(int status);

}  // namespace kvstash::harness
