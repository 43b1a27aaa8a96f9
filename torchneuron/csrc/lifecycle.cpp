// The device across the process's life: fork and interpreter exit (docs/device.md, "Fork" and "Exit").
//
// Fork. Python's before-fork hook (device/module.py) drains every stream, so the child's copy of memory holds
// finished results. At the fork itself, the forking thread's OpenMP thread pool is released (omp_pause_resource_all):
// libgomp keeps a pool per thread that ran a parallel region, and a forked child inherits the pool's bookkeeping but
// none of its threads, so the child's first parallel kernel (a plain CPU matmul) waits forever for them. The device
// makes that likely: its first call of a signature runs on the calling thread with that thread's OpenMP team. A
// child of a parent that had used the device (made device memory or queued work) may not use it: as CUDA's lazy
// initialisation refuses, every device use there raises "Cannot re-initialize neuron in forked subprocess".
//
// Exit. The exit-time drain is bounded; from its start other threads' device use is refused (a daemon thread still
// launching cannot keep it running: it is parked, below), it waits for the queued work at most `timeout` seconds,
// and leaves the exiting thread's later launches (atexit handlers that run after it) blocking, so nothing is queued
// after it. A pending kernel error is reported by device/module.py, which asks for a non-zero exit status here.
#include <Python.h>
#include <pthread.h>
#include <torch/csrc/utils/device_lazy_init.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "runtime.h"

extern "C" int omp_pause_resource_all(int kind) __attribute__((weak));  // OpenMP 5.0; libtorch_cpu's libgomp has it

namespace torchneuron {

std::atomic<int> g_lifecycle{static_cast<int>(Lifecycle::running)};

namespace {

constexpr int kOmpPauseSoft = 1;  // omp_pause_soft
std::atomic<bool> g_used_at_fork{false};
std::thread::id g_exiting_thread;
int g_exit_status = 0;

// Device memory made (ever) or a stream queue created: what CUDA's lazy initialisation marks.
bool device_used() {
  if (!queues_of(-1).empty()) return true;
  for (c10::DeviceIndex d = 0; d < device_count(); ++d) {
    const auto stats = neuron_allocator()->getDeviceStats(d);
    const auto& all = stats.allocation[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    if (all.allocated > 0 || all.current > 0) return true;
  }
  return false;
}

void before_fork() {
  g_used_at_fork.store(device_used() || g_lifecycle.load() == static_cast<int>(Lifecycle::forked_child));
  if (omp_pause_resource_all) omp_pause_resource_all(kOmpPauseSoft);  // this thread's pool: the child's thread
}

void in_forked_child() {
  reset_queues_after_fork();
  if (!g_used_at_fork.load()) return;
  g_lifecycle.store(static_cast<int>(Lifecycle::forked_child));
  // PyTorch calls torch.neuron._lazy_init again before making a neuron tensor, which raises (device/module.py)
  torch::utils::set_device_in_bad_fork(kNeuron, true);
  torch::utils::set_requires_device_init(kNeuron, true);
}

void exit_with_status() {
  std::exit(g_exit_status);  // at the very end of Py_FinalizeEx: every atexit handler and the teardown have run
}

}  // namespace

// A thread other than the exiting one that uses the device once the exit-time drain began (a daemon thread) sleeps
// until the process ends: it neither queues work nor returns. An error would have to unwind through PyTorch's
// binding, which takes the GIL back in a destructor; once the interpreter finalizes, CPython ends such a thread with
// pthread_exit, and its unwinding through that noexcept frame aborts the process ("terminate called without an
// active exception"; 2 of 10 runs of a daemon thread launching in a loop, when the launch raised). The same holds
// for a thread that was waiting for the device (queue.cpp's ReleaseGil).
void park_other_threads_at_exit() {
  if (g_lifecycle.load() != static_cast<int>(Lifecycle::exiting) || std::this_thread::get_id() == g_exiting_thread ||
      on_stream_worker())
    return;
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

void lifecycle_refuse() {
  switch (static_cast<Lifecycle>(g_lifecycle.load())) {
    case Lifecycle::running:
      return;
    case Lifecycle::forked_child:
      TORCH_CHECK(false, kBadForkMessage);
    case Lifecycle::exiting:
      park_other_threads_at_exit();
      return;
  }
}

void install_fork_handler() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(&before_fork, nullptr, &in_forked_child); });
}

bool in_bad_fork() { return g_lifecycle.load() == static_cast<int>(Lifecycle::forked_child); }

extern std::atomic<int> g_pushing;  // queue.cpp: threads inside a launch

std::vector<std::string> drain_for_exit(double timeout_s) {
  if (in_bad_fork()) return {};  // a child that may not use the device has nothing queued
  g_exiting_thread = std::this_thread::get_id();
  g_lifecycle.store(static_cast<int>(Lifecycle::exiting));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  auto pause = std::chrono::microseconds(100);
  constexpr auto kSettle = std::chrono::milliseconds(5);
  bool settled = false;
  std::vector<std::string> busy;
  for (;;) {  // a launch that passed its check just before the refusal may still queue: wait until every queue idles
    busy.clear();
    for (StreamQueue* q : queues_of(-1))
      if (!q->idle()) busy.push_back(c10::str("neuron:", static_cast<int>(q->device()), " stream ", q->id()));
    if (busy.empty() && g_pushing.load() == 0) {
      // Threads that launched just before the refusal return to Python (the GIL is free while this waits); their
      // next device use parks them. Then no other thread is inside a device call when the interpreter finalizes.
      if (!settled) {
        settled = true;
        std::this_thread::sleep_for(kSettle);
        continue;
      }
      break;
    }
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
  if (busy.empty()) g_launch_blocking.store(true);  // the exiting thread's later launches run at the call
  return busy;
}

void set_exit_status(int status) {
  static std::once_flag once;
  g_exit_status = status;
  std::call_once(once, [] { Py_AtExit(&exit_with_status); });
}

void bind_lifecycle(py::module_& m) {
  m.def("_check_device_use", &lifecycle_refuse,
        "Raise as a device use would here (in a forked child of a parent that had used the device); during the "
        "exit, a thread other than the exiting one sleeps until the process ends.");
  m.def("_in_bad_fork", &in_bad_fork,
        "Whether this process is a forked child of a parent that had used the device (device use raises here).");
  m.def(
      "_drain_all", [] { synchronize_device(-1, /*raise=*/false); },
      "Wait for every stream of every device, raising nothing (before a fork: a pending error stays pending).");
  m.def("_drain_for_exit", &drain_for_exit, py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
        "At interpreter exit: refuse other threads' device use, then wait at most `timeout` seconds for every "
        "stream; the streams still busy (empty: all drained, and this thread's later launches block).");
  m.def(
      "_raise_stream_error",
      [](size_t k) {
        auto qs = queues_of(-1);
        if (k >= qs.size()) return false;
        qs[k]->raise_error();
        return true;
      },
      py::arg("k"),
      "Raise the oldest pending kernel error of the k-th stream queue, as its sync point would; False when "
      "there is no k-th queue.");
  m.def("_set_exit_status", &set_exit_status, py::arg("status"),
        "Make the process exit with `status` once the interpreter has finished (after every atexit handler).");
}

}  // namespace torchneuron
