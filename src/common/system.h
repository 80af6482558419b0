// Small facts about this process and host, and unguessable random numbers.
#pragma once

#include <cstdint>
#include <string>

#include "kvstash/status.h"

namespace kvstash::sys {

// 64 random bits from the kernel's CSPRNG (getrandom); used for remote keys and nonces.
std::uint64_t random_u64();
// Fills `n` bytes from the kernel's CSPRNG.
void random_bytes(void* out, std::size_t n);

// This boot of this kernel (/proc/sys/kernel/random/boot_id): two processes that see the same
// id share a kernel, so shared memory between them is possible.
const std::string& boot_id();

// A secret kept in a file (a Redis password, a cluster token): its contents without the
// trailing newline. kInvalidArgument naming the path when it cannot be read (it came from
// the command line or a configuration).
Result<std::string> read_secret_file(const std::string& path);

}  // namespace kvstash::sys
