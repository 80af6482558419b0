// Small facts about this process and host, and unguessable random numbers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvstash/status.h"

namespace kvstash::sys {

// 64 random bits from the kernel's CSPRNG (getrandom); used for remote keys and nonces.
std::uint64_t random_u64();
// Fills `n` bytes from the kernel's CSPRNG.
void random_bytes(void* out, std::size_t n);

// This boot of this kernel (/proc/sys/kernel/random/boot_id): two processes that see the same
// id share a kernel, so shared memory between them is possible.
const std::string& boot_id();

// Maps `length` bytes of shared memory `fd` from `offset`, read-write, with page tables filled
// for writing now (MADV_POPULATE_WRITE, Linux 5.14; MAP_POPULATE before). MAP_POPULATE alone
// fills a shared mapping's page tables read-only, so each first write to a 4 KiB page still
// faults (measured: the first copy into a 64 MiB range at half the speed of later ones). With
// `populate` false, pages come in at first touch. MAP_FAILED and errno on failure.
void* map_shared(int fd, std::size_t length, std::uint64_t offset, bool populate);

// A secret kept in a file (a Redis password): its contents without the trailing newlines.
// kInvalidArgument naming the path when it cannot be read (it came from the command line or a
// configuration).
Result<std::string> read_secret_file(const std::string& path);

// OK when `mode` (a file's st_mode) lets only its owner read or write the file at `path`, else
// kInvalidArgument naming the path, the mode, `why` it must be private and the fix (chmod 600).
Status check_owner_only(unsigned mode, const std::string& path, std::string_view why);

// A secret that must stay private to its owner (the cluster token), checked as ssh checks a
// private key: read_secret_file's contents, or kInvalidArgument naming the path, its mode and
// the fix (chmod 600) when group or others may read or write it (mode & 077), and naming the
// path when it holds nothing but whitespace (which would turn authentication off unseen).
// The mode is that of the file opened, so a rename in between cannot slip past the check.
Result<std::string> read_private_secret_file(const std::string& path);

// The shortest cluster token accepted: a short token falls to an online guesser (and to an
// offline one holding a transcript) long before the handshake's backoff matters.
inline constexpr std::size_t kMinClusterTokenBytes = 16;

// A cluster token supplied explicitly (KVSTASH_CLUSTER_TOKEN, a token file, an API argument):
// OK, or kInvalidArgument naming `source` when it is empty or only whitespace (an empty token
// means "no token" to EngineOptions, so accepting one would turn authentication off without
// a word), or shorter than kMinClusterTokenBytes.
Status check_cluster_token(std::string_view token, std::string_view source);

// Tells the CPU that this thread spins (a pause on x86, a yield hint on Arm): the sibling
// hyperthread runs on, and the loop leaves the pipeline without a memory-order flush.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace kvstash::sys
