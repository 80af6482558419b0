// Memory for the Asio operations one connection starts again and again (a socket wait, its
// watchdog's timer, a hop onto its strand): a few fixed slots owned by the connection, so a
// warm connection's requests allocate nothing. Boost 1.74 recycles one block per thread and
// kind of operation, which a connection with a wait, a timer and a strand hop in flight at
// once overruns on every request.
//
// A handler made with on_arena() carries its executor and the arena: Asio allocates the
// operation that holds it from the arena and runs it on the executor. The arena must outlive
// every such operation; a handler that keeps its owner alive (a shared_ptr to the object
// holding the arena) guarantees that, since Asio frees an operation's memory before it lets
// go of the handler.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace kvstash {

class HandlerArena {
 public:
  // Operations on a connection hold a handler of a few pointers plus Asio's bookkeeping:
  // about 150-250 bytes. Larger requests, or more at once than there are slots, go to the
  // heap (correct, just not free).
  static constexpr std::size_t kSlots = 6;
  static constexpr std::size_t kSlotBytes = 384;

  HandlerArena() = default;
  HandlerArena(const HandlerArena&) = delete;
  HandlerArena& operator=(const HandlerArena&) = delete;

  // Thread-safe: Asio frees an operation on whichever thread completes it, while the
  // connection's strand may be allocating the next one on another.
  void* allocate(std::size_t bytes) {
    if (bytes <= kSlotBytes) {
      for (std::size_t i = 0; i < kSlots; ++i) {
        if (!used_[i].load(std::memory_order_relaxed) && !used_[i].exchange(true, std::memory_order_acquire)) {
          return slots_[i].bytes;
        }
      }
    }
    return ::operator new(bytes);
  }
  void deallocate(void* p) noexcept {
    const auto* byte = static_cast<const std::byte*>(p);
    const auto* first = slots_[0].bytes;
    if (byte >= first && byte < first + sizeof slots_) {
      used_[static_cast<std::size_t>(byte - first) / sizeof(Slot)].store(false, std::memory_order_release);
      return;
    }
    ::operator delete(p);
  }

 private:
  struct alignas(std::max_align_t) Slot {
    std::byte bytes[kSlotBytes];
  };
  static_assert(sizeof(Slot) == kSlotBytes);
  std::array<Slot, kSlots> slots_;
  std::array<std::atomic<bool>, kSlots> used_{};
};

template <typename T>
class ArenaAllocator {
 public:
  using value_type = T;
  explicit ArenaAllocator(HandlerArena& arena) noexcept : arena_(&arena) {}
  template <typename U>
  ArenaAllocator(const ArenaAllocator<U>& other) noexcept : arena_(other.arena()) {}

  T* allocate(std::size_t n) { return static_cast<T*>(arena_->allocate(n * sizeof(T))); }
  void deallocate(T* p, std::size_t) noexcept { arena_->deallocate(p); }
  HandlerArena* arena() const noexcept { return arena_; }

  template <typename U>
  friend bool operator==(const ArenaAllocator& a, const ArenaAllocator<U>& b) noexcept {
    return a.arena() == b.arena();
  }

 private:
  HandlerArena* arena_;
};

// `f` as an Asio completion handler that runs on `executor`, its operation in `arena`.
template <typename Executor, typename F>
class ArenaHandler {
 public:
  using executor_type = Executor;
  using allocator_type = ArenaAllocator<void>;

  ArenaHandler(const Executor& executor, HandlerArena& arena, F f)
      : executor_(executor), arena_(&arena), f_(std::move(f)) {}
  executor_type get_executor() const noexcept { return executor_; }
  allocator_type get_allocator() const noexcept { return allocator_type(*arena_); }

  template <typename... Args>
  void operator()(Args&&... args) {
    f_(std::forward<Args>(args)...);
  }

 private:
  Executor executor_;
  HandlerArena* arena_;
  F f_;
};

template <typename Executor, typename F>
ArenaHandler<Executor, std::decay_t<F>> on_arena(const Executor& executor, HandlerArena& arena, F&& f) {
  return {executor, arena, std::forward<F>(f)};
}

}  // namespace kvstash
