// Stream-ordered execution: each neuron stream is an in-order queue of kernels run by its own worker thread, as a
// NeuronCore (or a GPU) runs a stream's work while the host runs ahead. A launch returns once the kernel is queued;
// sync points wait for exactly the work they need (one stream up to a ticket, or a whole device). A kernel that
// throws keeps its error with the op's name and the Python stack that launched it, to be raised once at the stream's
// next sync point (and at those of the streams that waited for it); what it writes is poisoned (poison.cpp), so a later
// kernel reading that memory is skipped and poisons what it writes in turn, while independent work goes on.
// TORCHNEURON_LAUNCH_BLOCKING=1 runs every kernel at its launch instead.
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <Python.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "queue.h"
#include "runtime.h"

namespace torchneuron {

std::atomic<bool> g_launch_blocking{false};
std::atomic<bool> g_queue_everything{false};
std::atomic<bool> g_launch_stacks{true};

// lifecycle.cpp: once the exit-time drain began, a thread other than the exiting one never takes the GIL again
// (a stream worker excepted: the drain waits for it)
void park_other_threads_at_exit();
// Threads inside push(): the exit-time drain waits for them (lifecycle.cpp), and each parks on its way out.
std::atomic<int> g_pushing{0};

namespace {

thread_local bool t_stream_worker = false;
constexpr int kFixedStreams = 1 + 2 * 32;              // the default stream and the two priority pools (guard.cpp)
constexpr auto kSpin = std::chrono::microseconds(30);  // a worker (or waiter) spins this long before sleeping
const int kCores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

// Blocking while holding the GIL would stall every Python thread (and a kernel that needs it): release it.
struct ReleaseGil {
  PyThreadState* saved = Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr;
  ~ReleaseGil() {
    if (!saved) return;
    park_other_threads_at_exit();  // lifecycle.cpp
    PyEval_RestoreThread(saved);
  }
};

}  // namespace

StreamQueue::StreamQueue(c10::DeviceIndex device, c10::StreamId id) : device_(device), id_(id) {}

// This thread's intra-op threads, and only this thread's: OpenMP's per-thread setting and MKL's thread-local one.
// at::set_num_threads also stores a process-wide count that threads started later (autograd's) begin with, so a
// worker running a kernel with one thread fewer would change what later threads launch with. Both entries are the
// ones libtorch_cpu itself uses (its libgomp, its MKL); weak, so that a build without them (no MKL) still loads, and
// where they are missing or do not act on ATen's count, at::set_num_threads.
// MKL's C entry (its lower-case names take pointers). NOLINT: cpplint reads `int)` as a cast.
extern "C" void omp_set_num_threads(int) __attribute__((weak));       // NOLINT(readability/casting)
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));  // NOLINT(readability/casting)
void set_this_thread_threads(int n) {
  static const bool local = [] {
    if (!omp_set_num_threads || !MKL_Set_Num_Threads_Local) return false;
    const int before = at::get_num_threads(), probe = before == 1 ? 2 : 1;
    omp_set_num_threads(probe);
    const bool ok = at::get_num_threads() == probe;
    omp_set_num_threads(before);
    return ok;
  }();
  at::get_num_threads();  // ATen's lazy per-thread initialisation first: it would reset the count later
  if (!local) return at::set_num_threads(n);
  omp_set_num_threads(n);
  MKL_Set_Num_Threads_Local(n);
}

int kernel_threads(int threads, int64_t work) {
  // torch.use_deterministic_algorithms(True): every kernel with the thread count the CPU's would use, so that a
  // reduction splits as on the CPU and results equal the CPU's bit for bit at any core count
  return threads > 1 && threads >= kCores && work < kFullThreadsWork && !at::globalContext().deterministicAlgorithms()
             ? threads - 1
             : threads;
}

KernelThreadsGuard::KernelThreadsGuard(int64_t work) {
  const int now = at::get_num_threads(), want = kernel_threads(now, work);
  if (want != now) saved_ = now, set_this_thread_threads(want);
}
KernelThreadsGuard::~KernelThreadsGuard() {
  if (saved_) set_this_thread_threads(saved_);
}

uint64_t StreamQueue::push(const char* name, std::function<void()> run, bool control,
                           std::shared_ptr<const FusableOp> fuse, int64_t work, Access access) {
  // A launch that began before the exit-time drain returns through PyTorch's binding, which takes the GIL back: were
  // the interpreter finalizing by then, CPython would end the thread inside that noexcept frame and abort. So the
  // drain waits for launches in progress, and they park on the way out (lifecycle.cpp).
  // A thread parked by the drain must not count as a launch in progress: the drain would wait for it until its
  // timeout (a daemon thread launching at exit made every such exit take TORCHNEURON_EXIT_TIMEOUT).
  check_device_use();  // lifecycle.cpp: refused in a forked child; other threads park during exit
  struct Pushing {
    Pushing() {
      g_pushing.fetch_add(1);
      if (C10_UNLIKELY(g_lifecycle.load() != static_cast<int>(Lifecycle::running))) {  // the drain began since
        g_pushing.fetch_sub(1);
        park_other_threads_at_exit();  // returns on the exiting thread and on stream workers
        g_pushing.fetch_add(1);
      }
    }
    ~Pushing() {
      g_pushing.fetch_sub(1);
      park_other_threads_at_exit();
    }
  } pushing;
  // A bounded launch queue, as CUDA's (cudaLaunchKernel blocks with about 1,024 launches pending): a host far ahead
  // waits until half have run, so what queued work holds stays bounded and a sync never waits behind tens of
  // thousands of kernels.
  if (!control && !t_stream_worker) {
    const uint64_t queued = enqueued();
    if (queued - completed_.load(std::memory_order_relaxed) >= kMaxQueued) wait_quiet(queued - kMaxQueued / 2);
  }
  Task t{std::move(run),  name,
         nullptr,         kernel_threads(at::get_num_threads(), work),
         control,         c10::GradMode::is_enabled(),
         std::move(fuse), std::move(access)};
  if (!control && g_launch_stacks.load(std::memory_order_relaxed) &&
      Py_IsInitialized())  // bindings release the GIL: gathering takes it
    t.stack = gather_launch_stack();
  uint64_t ticket;
  bool wake;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!started_) {
      started_ = true;
      std::thread([this] { loop(); }).detach();  // queues live for the process: never joined
    }
    if (std::exchange(rearm_, false)) gate_.store(enqueued_.load(std::memory_order_relaxed)), cut_next_ = true;
    t.cut = std::exchange(cut_next_, false);
    tasks_.push_back(std::move(t));
    ticket = enqueued_.fetch_add(1, std::memory_order_relaxed) + 1;
    const uint64_t gate = gate_.load(std::memory_order_relaxed);
    if (gate != kOpen && ticket - gate > kMaxGated) gate_.store(kOpen);  // too long to hold
    wake = sleeping_ && takeable();
  }
  if (wake) work_cv_.notify_one();
  return ticket;
}

void StreamQueue::loop() {
  t_stream_worker = true;
  int threads = -1;
  std::vector<Task> group;  // the ops after `t` handed to eager fusion with it
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> l(mu_);
      if (!takeable()) {
        l.unlock();
        auto until = std::chrono::steady_clock::now() + kSpin;
        while ((pending() == 0 || popped_ >= gate_.load(std::memory_order_relaxed)) &&
               std::chrono::steady_clock::now() < until)
          std::this_thread::yield();
        l.lock();
      }
      while (!takeable()) {
        sleeping_ = true;
        work_cv_.wait(l);
        sleeping_ = false;
      }
      t = std::move(tasks_.front());
      tasks_.pop_front();
      ++popped_;
      // eager fusion: the fusable ops queued right behind this one (the host ran ahead) may become one kernel
      // (never over memory a failure left uncomputed: such an op is skipped on its own)
      while (t.fuse && !poisoned(t.access) && group.size() + 1 < fusion_max_ops() && takeable() &&
             tasks_.front().fuse && !tasks_.front().cut && tasks_.front().threads == t.threads &&
             !poisoned(tasks_.front().access)) {
        group.push_back(std::move(tasks_.front()));
        tasks_.pop_front();
        ++popped_;
      }
    }
    if (t.threads != threads) set_this_thread_threads(threads = t.threads);
    if (group.empty()) {
      finish(t, false);
      continue;
    }
    // the run, from each op on: fused as far as eager fusion takes it, else that op alone (or the ops of a group
    // still compiling)
    group.insert(group.begin(), std::move(t));
    std::vector<const FusableOp*> ops;
    for (const Task& g : group) ops.push_back(g.fuse.get());
    for (size_t k = 0; k < group.size();) {
      std::exception_ptr error;
      size_t unfused = 0;
      size_t fused =
          group.size() - k > 1 ? run_fused(c10::ArrayRef<const FusableOp*>(ops).slice(k), error, unfused) : 0;
      for (size_t end = k + std::max<size_t>({fused, unfused, 1}); k < end; ++k) {
        if (error) fail(group[k], error);  // the fused kernel raised: none of its ops runs again
        finish(group[k], fused > 0);
      }
    }
    group.clear();
  }
}

void StreamQueue::finish(Task& t, bool ran) {
  if (!ran) {
    if (FailurePtr f = t.control ? nullptr : poisoned(t.access)) {
      poison_writes(t.access, f);  // skipped: it reads what a failed kernel did not compute
    } else {
      try {
        // Kernels compute below autograd, on host aliases: an alias of an inference tensor (made under the launching
        // thread's torch.inference_mode) may be written here, where inference mode is not on.
        at::AutoDispatchBelowADInplaceOrView below;
        c10::AutoGradMode grad(t.grad);
        t.run();
        clear_poison(t.access);
      } catch (...) {
        fail(t, std::current_exception());
      }
    }
  }
  t.run = nullptr;  // the kernel's captured state goes before it counts as complete
  t.stack.reset();
  t.fuse.reset();
  // seq_cst with the load below and the waiter's store: a waiter either sees this count or is woken. Only a waiter
  // whose ticket this completes is woken (a host waiting at the end of a long backlog costs the worker no wake-up
  // per kernel).
  const uint64_t done = completed_.fetch_add(1) + 1;
  if (done >= wake_at_.load()) {
    std::lock_guard<std::mutex> g(mu_);
    wake_at_.store(kNoWaiter);  // a woken waiter whose ticket is still ahead registers it again
    done_cv_.notify_all();
  }
}

bool StreamQueue::reached(uint64_t ticket) const { return completed_.load(std::memory_order_acquire) >= ticket; }

bool StreamQueue::query(uint64_t ticket) {
  if (reached(ticket)) return true;
  let_go(ticket);  // a user polling for a held launch would otherwise wait for the run's end, which may never come
  return reached(ticket);
}

void StreamQueue::begin_run() {
  std::lock_guard<std::mutex> g(mu_);
  if (gate_.load(std::memory_order_relaxed) == kOpen) gate_.store(enqueued_.load());
  cut_next_ = true, rearm_ = false;
  marking_.store(true, std::memory_order_relaxed);
}

void StreamQueue::end_run() {
  bool wake;
  {
    std::lock_guard<std::mutex> g(mu_);
    gate_.store(kOpen);
    if (marking_.exchange(false, std::memory_order_relaxed)) cut_next_ = true;
    rearm_ = false;
    wake = sleeping_ && takeable();
  }
  if (wake) work_cv_.notify_one();
}

void StreamQueue::let_go(uint64_t ticket) {
  // outside a marked run, the gate is open (kOpen is above every ticket) or the wait is for launches before it
  if (!marking_.load(std::memory_order_relaxed) && ticket <= gate_.load()) return;
  bool wake = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (ticket > gate_.load(std::memory_order_relaxed)) {
      gate_.store(kOpen);
      wake = sleeping_ && takeable();
    }
    rearm_ = marking_.load(std::memory_order_relaxed) && gate_.load(std::memory_order_relaxed) == kOpen;
  }
  if (wake) work_cv_.notify_one();
}

void StreamQueue::wait_quiet(uint64_t ticket) {
  let_go(ticket);  // waiting for a launch the worker may not take yet would never end
  if (reached(ticket)) return;
  auto until = std::chrono::steady_clock::now() + kSpin;
  while (!reached(ticket) && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  if (reached(ticket)) return park_other_threads_at_exit();
  {
    ReleaseGil nogil;
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      if (ticket < wake_at_.load()) wake_at_.store(ticket);  // before the check: see finish()
      if (completed_.load() >= ticket) break;
      done_cv_.wait(l);
    }
  }
  // A daemon thread whose wait the exit-time drain ended parks here, also when PyTorch's binding (not this wait)
  // released its GIL: returning would take the GIL back in the binding while the interpreter finalizes, and abort.
  park_other_threads_at_exit();
}

void StreamQueue::wait(uint64_t ticket) {
  wait_quiet(ticket);
  raise_error();
}

void StreamQueue::fail(Task& t, std::exception_ptr error) {
  auto f = std::make_shared<Failure>();
  f->error = std::move(error), f->name = t.name, f->stack = std::move(t.stack);
  f->device = device_, f->stream = id_;
  poison_writes(t.access, f);
  std::lock_guard<std::mutex> g(mu_);
  hold(std::move(f), running());
}

// Every failure the user has not seen waits its turn: a sync point raises the oldest, the next one raises the one
// after it. Keeping only the first would drop a stream's own failure behind one it took on from another stream
// (whose sync point may report it first), and that error would never be raised.
void StreamQueue::hold(FailurePtr f, uint64_t at) {  // mu_ held
  while (!unseen_.empty() && unseen_.front().failure->reported.load()) unseen_.pop_front();
  for (const Held& h : unseen_)
    if (h.failure == f) return;  // taken on twice (two waits for the same work)
  unseen_.push_back({std::move(f), at});
  failed_.store(true, std::memory_order_relaxed);
}

std::vector<FailurePtr> StreamQueue::unreported_failures(uint64_t ticket) {
  std::vector<FailurePtr> out;
  if (!failed_.load(std::memory_order_relaxed)) return out;
  std::lock_guard<std::mutex> g(mu_);
  for (const Held& h : unseen_)
    if (h.at <= ticket && !h.failure->reported.load()) out.push_back(h.failure);
  return out;
}

void StreamQueue::take_failure(FailurePtr f, uint64_t at) {
  std::lock_guard<std::mutex> g(mu_);
  hold(std::move(f), at);
}

// The oldest failure the user has not seen, raised once; the memory it left uncomputed stays poisoned.
void StreamQueue::raise_error() {
  while (failed_.load(std::memory_order_relaxed)) {
    FailurePtr f;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (unseen_.empty()) return;
      f = std::move(unseen_.front().failure);
      unseen_.pop_front();
      failed_.store(!unseen_.empty(), std::memory_order_relaxed);
    }
    if (f->reported.exchange(true)) continue;  // the user has seen it already (a poisoned read, another stream's sync)
    rethrow_failure(*f, c10::str(" and reported at this sync point",
                                 f->stream == id_ ? "." : c10::str(" of stream ", id_, ", which waited for it.")));
  }
}

namespace {

struct Registry {
  std::mutex mu;
  std::vector<StreamQueue*> all;  // every queue ever made, for device syncs
  std::array<std::array<std::atomic<StreamQueue*>, kFixedStreams>, 128> fixed{};
  std::unordered_map<int64_t, StreamQueue*> fresh;  // (device << 56 | id) for getNewStream ids
};
Registry& registry() {
  static auto* r = new Registry;  // leaked: worker threads may outlive static destruction
  return *r;
}

}  // namespace

StreamQueue& queue_of(c10::DeviceIndex device, c10::StreamId id) {
  auto& r = registry();
  if (id >= 0 && id < kFixedStreams) {
    if (StreamQueue* q = r.fixed[device][id].load(std::memory_order_acquire)) return *q;
  }
  std::lock_guard<std::mutex> g(r.mu);
  if (id >= 0 && id < kFixedStreams) {
    if (StreamQueue* q = r.fixed[device][id].load(std::memory_order_relaxed)) return *q;
    auto* q = new StreamQueue(device, id);
    r.all.push_back(q);
    r.fixed[device][id].store(q, std::memory_order_release);
    return *q;
  }
  auto& slot = r.fresh[static_cast<int64_t>(device) << 56 | id];
  if (!slot) r.all.push_back(slot = new StreamQueue(device, id));
  return *slot;
}

StreamQueue& current_queue(c10::DeviceIndex device) {
  check_device_use();  // lifecycle.cpp: every op's path to its stream (queued or inline)
  return queue_of(device, current_stream_id(device));
}

std::vector<StreamQueue*> queues_of(c10::DeviceIndex device) {
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  std::vector<StreamQueue*> out;
  for (auto* q : r.all)
    if (device < 0 || q->device() == device) out.push_back(q);
  return out;
}

void synchronize_device(c10::DeviceIndex device, bool raise) {
  if (raise) check_device_use();  // lifecycle.cpp
  auto qs = queues_of(device);
  for (auto* q : qs) q->wait_quiet(q->enqueued());
  forget_freed_poison();
  if (!raise) return;
  // the first stream's oldest unseen failure is raised; the others' wait for the next sync point (each raised once)
  for (auto* q : qs) q->raise_error();
}

void drain_current(c10::DeviceIndex device) {
  StreamQueue& q = current_queue(device);
  if (!q.idle())
    q.wait(q.enqueued());
  else
    q.raise_error();
}

// A forked child has none of the parent's worker threads: its queues start empty (whatever the parent had queued
// is the parent's to run), so a wait in the child never hangs on work no thread will do.
void reset_queues_after_fork() {
  auto& r = registry();
  new (&r.mu) std::mutex();
  for (auto* q : r.all) q->reset_after_fork();
}

void mark_run(bool begin) {
  if (!begin) {  // every queue: the current stream may have changed inside the run
    for (auto* q : queues_of(-1)) q->end_run();
    return;
  }
  std::vector<c10::DeviceIndex> devices;
  for (auto* q : queues_of(-1))
    if (std::find(devices.begin(), devices.end(), q->device()) == devices.end()) devices.push_back(q->device());
  for (auto d : devices) queue_of(d, current_stream_id(d)).begin_run();
}

bool on_stream_worker() { return t_stream_worker; }

void StreamQueue::reset_after_fork() {
  new (&mu_) std::mutex();
  new (&work_cv_) std::condition_variable();
  new (&done_cv_) std::condition_variable();
  new (&tasks_) std::deque<Task>();  // the parent's tasks are leaked, not run
  started_ = sleeping_ = cut_next_ = rearm_ = false;
  marking_.store(false);
  gate_.store(kOpen);
  completed_.store(enqueued_.load());
  popped_ = enqueued_.load();
  wake_at_.store(kNoWaiter);
}

}  // namespace torchneuron
