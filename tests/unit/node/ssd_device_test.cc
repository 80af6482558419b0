// The NVMe tier's device layer (src/node/ssd_device.h) on a file of this machine's disk
// (O_DIRECT, io_uring): bytes round-trip through many concurrent batches, bad I/O is refused
// before it reaches the device, an injected EIO is that I/O's error and no other's, a deadline
// that passed is kTimeout, and what could not be opened says why.
#include "node/ssd_device.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "kvstash/memory.h"

namespace kvstash::node {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kCapacity = 64 << 20;

class SsdDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Beside the build: the disk, where O_DIRECT works (not a tmpfs /tmp).
    path_ = (std::filesystem::current_path() / ("ssd-test-" + std::to_string(::getpid()))).string();
    auto d = SsdDevice::open({.path = path_, .capacity = kCapacity});
    if (d.status().code() == StatusCode::kUnsupported) GTEST_SKIP() << d.status().to_string();
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    device_ = std::move(d).value();
  }
  void TearDown() override {
    device_.reset();
    ::unlink(path_.c_str());
  }
  static Buffer buffer(std::size_t bytes) { return Buffer::allocate(bytes).value(); }

  std::string path_;
  std::unique_ptr<SsdDevice> device_;
};

TEST_F(SsdDeviceTest, BytesRoundTripThroughConcurrentBatches) {
  EXPECT_EQ(device_->capacity(), kCapacity);
  EXPECT_EQ(device_->block_size(), 4096u);
  EXPECT_STREQ(device_->kind(), "file");
  constexpr int kThreads = 4, kRounds = 16;
  constexpr std::size_t kChunk = 256 << 10;  // each thread owns its own 4 MiB of the device
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Buffer out = buffer(4 * kChunk), in = buffer(4 * kChunk);
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 1);
      for (int round = 0; round < kRounds; ++round) {
        auto* words = reinterpret_cast<std::uint64_t*>(out.data());
        for (std::size_t i = 0; i < out.size() / 8; ++i) words[i] = rng();
        std::vector<SsdIo> writes, reads;
        for (std::size_t c = 0; c < 4; ++c) {
          const std::uint64_t at = (static_cast<std::uint64_t>(t) * 16 + (round % 4) * 4 + c) * kChunk;
          writes.push_back(
              {.write = true, .offset = at, .buffer = out.data() + c * kChunk, .length = kChunk});
          reads.push_back({.write = false, .offset = at, .buffer = in.data() + c * kChunk, .length = kChunk});
        }
        std::memset(in.data(), 0, in.size());
        if (!device_->run(writes, deadline_after(10s)).is_ok() ||
            !device_->run(reads, deadline_after(10s)).is_ok() ||
            std::memcmp(in.data(), out.data(), out.size()) != 0) {
          ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  const auto c = device_->counters();
  EXPECT_EQ(c.writes, static_cast<std::uint64_t>(kThreads * kRounds * 4));
  EXPECT_EQ(c.read_bytes, static_cast<std::uint64_t>(kThreads * kRounds * 4) * kChunk);
  EXPECT_EQ(c.errors, 0u);
  EXPECT_TRUE(device_->flush().is_ok());

  // Reopened: the bytes are the file's.
  Buffer keep = buffer(4096);
  std::memset(keep.data(), 0x5a, keep.size());
  ASSERT_TRUE(device_
                  ->run({{.write = true, .offset = kCapacity - 4096, .buffer = keep.data(), .length = 4096}},
                        deadline_after(10s))
                  .is_ok());
  device_.reset();
  device_ = SsdDevice::open({.path = path_, .capacity = kCapacity}).value();
  Buffer back = buffer(4096);
  ASSERT_TRUE(device_
                  ->run({{.write = false, .offset = kCapacity - 4096, .buffer = back.data(), .length = 4096}},
                        deadline_after(10s))
                  .is_ok());
  EXPECT_EQ(std::memcmp(back.data(), keep.data(), 4096), 0);
}

TEST_F(SsdDeviceTest, MisalignedOrOutOfRangeIoIsRefusedBeforeTheDevice) {
  Buffer b = buffer(2 * 4096);
  const std::vector<SsdIo> bad = {
      {.write = false, .offset = 100, .buffer = b.data(), .length = 4096},        // offset
      {.write = false, .offset = 0, .buffer = b.data(), .length = 100},           // length
      {.write = false, .offset = 0, .buffer = b.data() + 8, .length = 4096},      // buffer
      {.write = false, .offset = kCapacity, .buffer = b.data(), .length = 4096},  // past the end
      {.write = false, .offset = kCapacity - 4096, .buffer = b.data(), .length = 8192},
      {.write = false, .offset = 0, .buffer = nullptr, .length = 4096},
      {.write = false, .offset = 0, .buffer = b.data(), .length = 0},
  };
  for (const SsdIo& io : bad) {
    Status s = device_->run({io}, deadline_after(5s));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string() << " offset " << io.offset;
  }
  EXPECT_EQ(device_->counters().reads, 0u);
}

TEST_F(SsdDeviceTest, AnInjectedEioFailsItsIoAndNoOther) {
  Buffer b = buffer(3 * 4096);
  std::memset(b.data(), 0x11, b.size());
  device_->set_fault([](const SsdIo& io) { return io.offset == 4096 ? EIO : 0; });
  Status s = device_->run({{.write = true, .offset = 0, .buffer = b.data(), .length = 4096},
                           {.write = true, .offset = 4096, .buffer = b.data() + 4096, .length = 4096},
                           {.write = true, .offset = 8192, .buffer = b.data() + 8192, .length = 4096}},
                          deadline_after(5s));
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
  EXPECT_EQ(device_->counters().writes, 2u) << "the other two went to the device";
  device_->set_fault([](const SsdIo&) { return ENOSPC; });
  EXPECT_EQ(
      device_->run({{.write = true, .offset = 0, .buffer = b.data(), .length = 4096}}, deadline_after(5s))
          .code(),
      StatusCode::kNoSpace);
  device_->set_fault(nullptr);
  EXPECT_TRUE(
      device_->run({{.write = false, .offset = 0, .buffer = b.data(), .length = 4096}}, deadline_after(5s))
          .is_ok());
  // A deadline that passed: nothing is submitted.
  EXPECT_EQ(
      device_->run({{.write = false, .offset = 0, .buffer = b.data(), .length = 4096}}, Clock::now()).code(),
      StatusCode::kTimeout);
}

TEST(SsdDeviceOpen, WhatCannotBeOpenedSaysWhy) {
  EXPECT_EQ(SsdDevice::open({}).status().code(), StatusCode::kInvalidArgument);
  const std::string file = (std::filesystem::current_path() / "ssd-open-test").string();
  auto no_capacity = SsdDevice::open({.path = file});
  EXPECT_EQ(no_capacity.status().code(), StatusCode::kInvalidArgument) << no_capacity.status().to_string();
  EXPECT_NE(no_capacity.status().message().find("--ssd-capacity"), std::string::npos);
  ::unlink(file.c_str());
  auto missing_dir = SsdDevice::open({.path = "/nonexistent-dir/tier", .capacity = 1 << 20});
  EXPECT_FALSE(missing_dir.is_ok());
  // A capacity no file system here holds.
  auto huge = SsdDevice::open({.path = file, .capacity = std::uint64_t{1} << 60});
  EXPECT_FALSE(huge.is_ok());
  EXPECT_TRUE(huge.status().code() == StatusCode::kNoSpace || huge.status().code() == StatusCode::kIoError)
      << huge.status().to_string();
  ::unlink(file.c_str());
}

// The tier holds prompts' KV: a file that group or others may read (made before, with a
// umask's 0644) is refused, saying how to fix it, as the token file is; the owner's alone opens.
TEST(SsdDeviceOpen, AFileOthersMayReadIsRefused) {
  const std::string file = (std::filesystem::current_path() / "ssd-mode-test").string();
  ::unlink(file.c_str());
  const int fd = ::open(file.c_str(), O_CREAT | O_WRONLY, 0644);
  ASSERT_GE(fd, 0);
  ::close(fd);
  ASSERT_EQ(::chmod(file.c_str(), 0644), 0);
  auto shared = SsdDevice::open({.path = file, .capacity = 1 << 20});
  EXPECT_EQ(shared.status().code(), StatusCode::kInvalidArgument) << shared.status().to_string();
  EXPECT_NE(shared.status().message().find("chmod 600"), std::string::npos) << shared.status().to_string();
  ASSERT_EQ(::chmod(file.c_str(), 0640), 0);
  EXPECT_EQ(SsdDevice::open({.path = file, .capacity = 1 << 20}).status().code(),
            StatusCode::kInvalidArgument)
      << "the group may read it";
  ASSERT_EQ(::chmod(file.c_str(), 0600), 0);
  auto own = SsdDevice::open({.path = file, .capacity = 1 << 20});
  if (own.status().code() != StatusCode::kUnsupported) {
    EXPECT_TRUE(own.is_ok()) << own.status().to_string();
  }
  own = Status::internal("closed");
  // A file the tier creates is its owner's alone.
  ::unlink(file.c_str());
  auto created = SsdDevice::open({.path = file, .capacity = 1 << 20});
  if (created.is_ok()) {
    struct stat st {};
    ASSERT_EQ(::stat(file.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  created = Status::internal("closed");
  ::unlink(file.c_str());
}

}  // namespace
}  // namespace kvstash::node
