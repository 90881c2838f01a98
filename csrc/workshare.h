// Work sharing for the CPU kernels (kvcopy.cpp, kvcodec.cpp).
//
// Tasks [0, tasks) are claimed in batches from a shared counter by the
// calling thread and by up to torch.get_num_threads() - 1 helpers from
// torch's inter-op pool. The caller works too and waits only for batches
// actually claimed, never for a helper to show up: on a busy machine a pool
// thread can be scheduled milliseconds late, and an OpenMP region
// (at::parallel_for) would wait for it at its barrier with its static share
// of the work still to do. A late helper finds nothing left and returns
// without calling `fn`; it holds the shared state by shared_ptr, so the
// caller may already have returned. `fn` must not throw.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

namespace pdkv {

inline void share_work(int64_t tasks, int64_t batch, std::function<void(int64_t, int64_t)> fn) {
  if (tasks <= 0) return;
  struct State {
    std::function<void(int64_t, int64_t)> fn;
    int64_t tasks;
    int64_t batch;
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
  batch = std::max<int64_t>(1, batch);
  auto state = std::make_shared<State>();
  state->fn = std::move(fn);
  state->tasks = tasks;
  state->batch = batch;
  const int64_t batches = (tasks + batch - 1) / batch;
  const int64_t helpers = std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()), batches,
                                             static_cast<int64_t>(at::get_num_interop_threads()) + 1}) - 1;
  // Helpers run on torch's inter-op pool: its tasks are fire-and-forget, which
  // is what lets the caller finish without them.
  for (int64_t h = 0; h < helpers; ++h) at::launch([state] { state->work(); });
  state->work();
  while (state->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
}

}  // namespace pdkv
