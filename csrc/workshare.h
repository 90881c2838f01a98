// Work sharing for the CPU kernels (kvcopy.cpp, kvcodec.cpp).
//
// Tasks [0, tasks) are claimed in batches from a shared counter by the
// calling thread and by up to `threads` - 1 helpers from a small pool owned
// by this library (the caller passes torch.get_num_threads(), so the thread
// count follows torch.set_num_threads like any CPU op). The caller works too
// and waits only for batches actually claimed, never for a helper to show up:
// on a busy machine a pool thread can be scheduled milliseconds late, and a
// barrier (an OpenMP region) would wait for it with its static share of the
// work still to do. A late helper finds nothing left and returns without
// calling `fn`; it holds the shared state by shared_ptr, so the caller may
// already have returned. `fn` must not throw.
//
// The library has no torch headers (it is a plain C ABI library loaded with
// ctypes), hence its own pool rather than torch's inter-op pool. A fork()ed
// child starts with a fresh, empty pool (pthread_atfork): the parent's threads
// do not exist there and its pool's mutex may be held.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace pdkv {

struct ShareState {
  std::function<void(int64_t, int64_t)> fn;
  int64_t tasks = 0;
  int64_t batch = 1;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    for (int64_t begin; (begin = next.fetch_add(batch, std::memory_order_relaxed)) < tasks;) {
      const int64_t end = std::min(begin + batch, tasks);
      fn(begin, end);
      done.fetch_add(end - begin, std::memory_order_release);
    }
  }
};

// Detached helper threads, started on demand up to the most ever asked for.
class HelperPool {
 public:
  void submit(const std::shared_ptr<ShareState>& state, int64_t helpers) {
    std::lock_guard<std::mutex> guard(mutex_);
    while (started_ < helpers && started_ < kMaxThreads) {
      std::thread([this] { run(); }).detach();
      ++started_;
    }
    for (int64_t h = 0; h < helpers; ++h) queue_.push_back(state);
    ready_.notify_all();
  }

  static HelperPool& instance() {
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, [] { current() = new HelperPool(); });  // the old one is leaked: its threads are gone
      return true;
    }();
    (void)registered;
    return *current();
  }

 private:
  static constexpr int64_t kMaxThreads = 256;

  static HelperPool*& current() {
    static HelperPool* pool = new HelperPool();  // never destroyed: detached threads wait on it until the process ends
    return pool;
  }

  void run() {
    for (;;) {
      std::shared_ptr<ShareState> state;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return !queue_.empty(); });
        state = std::move(queue_.front());
        queue_.pop_front();
      }
      state->work();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::shared_ptr<ShareState>> queue_;
  int64_t started_ = 0;
};

inline void share_work(int64_t tasks, int64_t batch, int64_t threads, std::function<void(int64_t, int64_t)> fn) {
  if (tasks <= 0) return;
  batch = std::max<int64_t>(1, batch);
  auto state = std::make_shared<ShareState>();
  state->fn = std::move(fn);
  state->tasks = tasks;
  state->batch = batch;
  const int64_t batches = (tasks + batch - 1) / batch;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(threads, 1), batches) - 1;
  if (helpers > 0) HelperPool::instance().submit(state, helpers);
  state->work();
  while (state->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
}

}  // namespace pdkv
