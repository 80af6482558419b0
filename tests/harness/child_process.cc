#include "tests/harness/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

extern char** environ;

namespace kvstash::harness {
namespace {

using namespace std::chrono_literals;

int decode_wait_status(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return 255;
}

// Milliseconds to `deadline` for poll(): at least 0, rounded up so we never spin.
int poll_ms(Deadline deadline) {
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<std::int64_t>(left, 0, 1000 * 1000));
}

}  // namespace

std::string describe_status(int status) {
  if (status > 128 && status < 128 + 65) {
    return "was killed by signal " + std::to_string(status - 128) + " (" + strsignal(status - 128) + ")";
  }
  return "exited with status " + std::to_string(status);
}

Result<ChildProcess> ChildProcess::start(const ChildOptions& options) {
  if (options.argv.empty() || options.argv[0].empty()) {
    return Status::invalid_argument("no program to run");
  }
  // Everything the child touches is prepared before fork(): in a multithreaded parent the
  // child may only make async-signal-safe calls (no allocation) until it execs.
  std::vector<std::string> argv_store = options.argv;
  std::vector<char*> argv;
  for (auto& a : argv_store) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::vector<std::string> env_store;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view entry(*e);
    const auto name = entry.substr(0, entry.find('='));
    const bool replaced =
        std::any_of(options.env.begin(), options.env.end(), [&](const auto& kv) { return kv.first == name; });
    const bool unset =
        std::find(options.unset_env.begin(), options.unset_env.end(), name) != options.unset_env.end();
    if (!replaced && !unset) env_store.emplace_back(entry);
  }
  for (const auto& [name, value] : options.env) env_store.push_back(name + "=" + value);
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);

  UniqueFd devnull(::open("/dev/null", O_RDWR | O_CLOEXEC));
  if (devnull.get() < 0) return Status::from_errno("open /dev/null", errno);
  int p[2];
  UniqueFd out_read, out_write;
  if (options.capture_stdout) {
    if (::pipe2(p, O_CLOEXEC) != 0) return Status::from_errno("pipe", errno);
    out_read = UniqueFd(p[0]);
    out_write = UniqueFd(p[1]);
  }
  // The child reports a failed exec through this pipe; a successful exec closes it.
  if (::pipe2(p, O_CLOEXEC) != 0) return Status::from_errno("pipe", errno);
  UniqueFd err_read(p[0]), err_write(p[1]);

  const long open_max = std::clamp(::sysconf(_SC_OPEN_MAX), 1024L, 65536L);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Status::from_errno("fork", errno);
  if (pid == 0) {
    // Die with the parent (strictly: with the thread that forked) so nothing outlives a
    // crashed benchmark or test; the getppid() check closes the race with a parent that
    // died before prctl.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    // A process group of its own: a Ctrl-C at the terminal reaches only the parent, which
    // can then stop its children in order (the node drains before Redis goes) and remove
    // their directories. Should the parent die of it instead, PDEATHSIG still applies.
    if (options.own_process_group) ::setpgid(0, 0);
    // Signal dispositions that were SIG_IGN and the blocked mask survive exec: a parent that
    // blocks SIGTERM for a signal thread would otherwise make its children ignore it.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; ++sig) ::sigaction(sig, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(devnull.get(), 0);
    ::dup2(options.capture_stdout ? out_write.get() : devnull.get(), 1);
    if (options.discard_stderr) ::dup2(devnull.get(), 2);
    // The child inherits nothing else of ours (sockets of our engine, Redis connections,
    // other children's pipes), whether or not their owner asked for close-on-exec. The
    // error pipe stays until exec closes it.
    const int keep = err_write.get();
    if ((keep > 3 && ::close_range(3, keep - 1, 0) != 0) || ::close_range(keep + 1, ~0u, 0) != 0) {
      for (long fd = 3; fd < open_max; ++fd) {  // kernels before 5.9
        if (fd != keep) ::close(static_cast<int>(fd));
      }
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    const int e = errno;
    [[maybe_unused]] auto n = ::write(keep, &e, sizeof e);
    ::_exit(127);
  }
  err_write.reset();
  out_write.reset();
  int exec_errno = 0;
  ssize_t n;
  do {
    n = ::read(err_read.get(), &exec_errno, sizeof exec_errno);
  } while (n < 0 && errno == EINTR);
  if (n == sizeof exec_errno) {
    int st = 0;
    while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    const std::string& prog = options.argv[0];
    if (exec_errno == ENOENT) return Status::not_found(prog + ": no such program");
    if (exec_errno == EACCES) return Status::permission_denied(prog + ": not executable");
    return Status::from_errno("exec " + prog, exec_errno);
  }
  ChildProcess child;
  child.pid_ = pid;
  child.stdout_fd_ = out_read.release();
  child.eof_ = !options.capture_stdout;
  return child;
}

ChildProcess::ChildProcess(ChildProcess&& o) noexcept
    : pid_(std::exchange(o.pid_, -1)),
      stdout_fd_(std::exchange(o.stdout_fd_, -1)),
      eof_(o.eof_),
      pending_(std::move(o.pending_)),
      status_(std::exchange(o.status_, std::nullopt)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& o) noexcept {
  if (this != &o) {
    reset();
    pid_ = std::exchange(o.pid_, -1);
    stdout_fd_ = std::exchange(o.stdout_fd_, -1);
    eof_ = o.eof_;
    pending_ = std::move(o.pending_);
    status_ = std::exchange(o.status_, std::nullopt);
  }
  return *this;
}

ChildProcess::~ChildProcess() { reset(); }

void ChildProcess::reset() {
  if (pid_ > 0) kill();
  if (stdout_fd_ >= 0) ::close(std::exchange(stdout_fd_, -1));
  pending_.clear();
  eof_ = false;
  status_.reset();
}

std::optional<std::string> ChildProcess::read_line(Deadline deadline) {
  for (;;) {
    const auto nl = pending_.find('\n');
    if (nl != std::string::npos) {
      std::string line = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      return line;
    }
    if (stdout_fd_ < 0 || eof_) {
      eof_ = true;
      if (!pending_.empty()) return std::exchange(pending_, {});
      return std::nullopt;
    }
    pollfd p{stdout_fd_, POLLIN, 0};
    const int r = ::poll(&p, 1, poll_ms(deadline));
    if (r < 0 && errno != EINTR) {
      eof_ = true;
      continue;
    }
    if (r <= 0) {
      if (Clock::now() >= deadline) return std::nullopt;
      continue;
    }
    char buf[4096];
    const ssize_t n = ::read(stdout_fd_, buf, sizeof buf);
    if (n > 0) {
      pending_.append(buf, static_cast<std::size_t>(n));
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
      eof_ = true;
      ::close(std::exchange(stdout_fd_, -1));
    }
  }
}

void ChildProcess::signal(int sig) {
  if (pid_ > 0) ::kill(pid_, sig);
}

std::optional<int> ChildProcess::wait(Deadline deadline) {
  if (status_) return status_;
  if (pid_ <= 0) return std::nullopt;
  auto backoff = 1ms;
  for (;;) {
    int st = 0;
    const bool block = deadline == Deadline::max();
    const pid_t r = ::waitpid(pid_, &st, block ? 0 : WNOHANG);
    if (r == pid_) {
      status_ = decode_wait_status(st);
      pid_ = -1;
      return status_;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {  // ECHILD: reaped behind our back; its status is lost
      status_ = 255;
      pid_ = -1;
      return status_;
    }
    const auto now = Clock::now();
    if (now >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, 20ms);
  }
}

int ChildProcess::kill() {
  if (status_) return *status_;
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGKILL);
  return *wait(Deadline::max());
}

}  // namespace kvstash::harness
