// Memory the host must never touch, for the test doubles of device memory (the CUDA model's
// cudaMalloc, the device stand-in's sealed mapping): their ranges are mapped PROT_NONE, and a
// host access faults. watch() makes such a fault name itself: the SIGSEGV handler (installed
// once) writes the range's message and the address, and aborts; a fault elsewhere goes to the
// handler that was there before. Header-only: each binary that includes it has its own table.
//
// Thread safety: watch and unwatch may be called from any thread; the handler reads the table
// without locks (atomics only).
#pragma once

#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>

namespace kvstash::test::host_faults {

// What a fault in a range says: called in the signal handler (async-signal-safe: return a
// constant string).
using Message = const char* (*)();

namespace detail {

struct Range {
  std::atomic<std::uintptr_t> begin{0}, end{0};
  std::atomic<Message> message{nullptr};
};
inline std::array<Range, 4096> ranges;
inline struct sigaction previous {};

inline void write_fault(const char* what, std::uintptr_t at) {
  char buf[256];
  std::size_t n = 0;
  for (const char* p = what; *p != '\0' && n < 200; ++p) buf[n++] = *p;
  buf[n++] = '0';
  buf[n++] = 'x';
  for (int shift = 60; shift >= 0; shift -= 4) buf[n++] = "0123456789abcdef"[(at >> shift) & 0xf];
  for (const char* p = " ***\n"; *p != '\0'; ++p) buf[n++] = *p;
  (void)!::write(2, buf, n);
}

inline void on_fault(int sig, siginfo_t* info, void* ctx) {
  const auto at = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (const Range& r : ranges) {
    if (at >= r.begin.load() && at < r.end.load()) {
      write_fault(r.message.load()(), at);
      ::abort();
    }
  }
  // Not watched memory: what was there before (the default: die).
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(sig, info, ctx);
    return;
  }
  ::signal(sig, previous.sa_handler == SIG_IGN ? SIG_DFL : previous.sa_handler);
  ::raise(sig);
}

}  // namespace detail

// From now on a host access to [base, base + size) aborts saying message() and the address.
// A full table (4096 ranges) leaves the range faulting without the message.
inline void watch(const void* base, std::size_t size, Message message) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction sa {};
    sa.sa_sigaction = detail::on_fault;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGSEGV, &sa, &detail::previous);
  });
  const auto b = reinterpret_cast<std::uintptr_t>(base);
  for (detail::Range& r : detail::ranges) {
    std::uintptr_t expected = 0;
    if (r.begin.compare_exchange_strong(expected, b)) {
      r.message.store(message);
      r.end.store(b + size);
      return;
    }
  }
}

inline void unwatch(const void* base) {
  for (detail::Range& r : detail::ranges) {
    if (r.begin.load() == reinterpret_cast<std::uintptr_t>(base)) {
      r.end.store(0);
      r.begin.store(0);
    }
  }
}

}  // namespace kvstash::test::host_faults
