// queue.cpp's interface: stream-ordered execution.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "poison.h"

namespace torchneuron {

// ---- queue.cpp: stream-ordered execution (each stream an in-order queue run by its own worker thread) ----
extern std::atomic<bool> g_launch_blocking;  // TORCHNEURON_LAUNCH_BLOCKING: kernels run at their launch
// Tests only: queue every kernel with a known layout, also small ones on an idle stream (so that conformance suites
// exercise the queued path).
extern std::atomic<bool> g_queue_everything;
extern std::atomic<bool> g_launch_stacks;  // keep each queued kernel's launching Python stack (for its error)
struct FusableOp;                          // fusion.cpp
class StreamQueue {
 public:
  StreamQueue(c10::DeviceIndex device, c10::StreamId id);
  // Queue `run` and return its ticket: the queue has run it once reached(ticket). A kernel keeps its launching
  // Python stack for its error; `control` tasks (event records, cross-stream waits) run even after a kernel of
  // the stream failed, kernels are then skipped until the error is reported.
  // `fuse`: the op as the worker may hand it to eager fusion with the queued ops that follow it (fusion.cpp).
  // `work`: the kernel's size in elements (its largest tensor, or an estimate of its work): sets its threads (below).
  // `access`: the device storages it reads and writes. A kernel reading memory that a failed (or skipped) kernel
  // should have written is skipped, and what it writes is poisoned with that failure (poison.cpp).
  uint64_t push(const char* name, std::function<void()> run, bool control = false,
                std::shared_ptr<const FusableOp> fuse = nullptr, int64_t work = 0, Access access = {});
  uint64_t enqueued() const { return enqueued_.load(std::memory_order_acquire); }
  bool reached(uint64_t ticket) const;
  bool query(uint64_t ticket);  // reached(), for a user polling (an event, a stream): first lets a held run go
  // A run the host marks (an optimizer step: begin_run .. end_run) reaches the worker whole, wherever the host was
  // when it began: the worker takes none of its launches until it ends, and eager fusion groups no op across either
  // end. So the runs a step hands to fusion are the same every step, whether the host ran ahead or had just waited
  // (the loss read before the step). Whatever waits for a held launch (any sync point, a full queue) lets it go.
  void begin_run();
  void end_run();
  bool idle() const { return reached(enqueued()); }
  void wait(uint64_t ticket);        // a sync point: waits, then raises the stream's pending error
  void wait_quiet(uint64_t ticket);  // ordering only (a worker waiting on another stream, the allocator)
  void raise_error();                // the pending error of a failed kernel, with where it was launched
  // A stream waiting (an event, wait_stream) for this one's work up to `ticket` takes on the failures it has not
  // reported yet: the error surfaces on every stream that depends on the failed work. take_failure: on the worker.
  std::vector<FailurePtr> unreported_failures(uint64_t ticket);
  void take_failure(FailurePtr f, uint64_t at);               // at: its place in this stream (a ticket)
  uint64_t running() const { return completed_.load() + 1; }  // the worker's: the ticket of the task it runs
  c10::DeviceIndex device() const { return device_; }
  c10::StreamId id() const { return id_; }
  void reset_after_fork();

 private:
  struct Task {
    std::function<void()> run;
    const char* name = "";
    std::shared_ptr<c10::GatheredContext> stack;
    int threads = 1;  // the intra-op threads it runs with: kernel_threads() of the launching thread's
    bool control = false;
    bool grad = true;  // the launching thread's grad mode: some CPU kernels' results depend on it (oneDNN's LSTM
                       // keeps its workspace only with grad enabled)
    std::shared_ptr<const FusableOp> fuse;
    Access access;
    bool cut = false;  // a marked run begins or has ended here: eager fusion groups no op across it
  };
  void finish(Task& t, bool ran);  // run `t` (unless `ran`: a fused kernel did its work) and count it complete
  void fail(Task& t, std::exception_ptr error);  // `t` threw: poison what it writes, keep the error to report
  void hold(FailurePtr f, uint64_t at);          // queue `f` behind the failures not yet seen (mu_ held)
  void loop();
  uint64_t pending() const { return enqueued_.load(std::memory_order_acquire) - popped_; }
  bool takeable() const { return !tasks_.empty() && popped_ < gate_.load(std::memory_order_relaxed); }  // mu_
  void let_go(uint64_t ticket);  // something waits for `ticket`: a held run it reaches goes to the worker
  const c10::DeviceIndex device_;
  const c10::StreamId id_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Task> tasks_;
  std::atomic<uint64_t> enqueued_{0}, completed_{0};
  uint64_t popped_ = 0;  // the worker's
  static constexpr uint64_t kNoWaiter = ~uint64_t{0};
  static constexpr uint64_t kMaxQueued = 1024;  // launches pending before the launching thread waits (push)
  std::atomic<uint64_t> wake_at_{kNoWaiter};    // the lowest ticket a sleeping waiter waits for
  // The gate of a marked run being queued: the worker takes no launch with a ticket above it (written under mu_),
  // kOpen outside one. A run longer than kMaxGated launches (an optimizer stepping tensor by tensor: nothing to fuse)
  // goes before it ends, so the worker does not idle while the host queues it.
  static constexpr uint64_t kOpen = ~uint64_t{0}, kMaxGated = 64;
  std::atomic<uint64_t> gate_{kOpen};
  bool cut_next_ = false;             // (mu_) the next launch pushed is a Task::cut
  std::atomic<bool> marking_{false};  // inside begin_run .. end_run (written under mu_)
  // (mu_) A wait inside the marked run let it go: the next launch holds again, so what the run queues after a sync
  // inside it (a step's closure reading the loss) reaches the worker whole too.
  bool rearm_ = false;
  // The failures not yet reported at a sync point, in the order this stream met them (its own, and those it took
  // on by waiting for another stream), each with its place in this stream.
  struct Held {
    FailurePtr failure;
    uint64_t at;
  };
  std::deque<Held> unseen_;
  std::atomic<bool> failed_{false};  // unseen_ is not empty
  bool started_ = false, sleeping_ = false;
};
// The host marks a run (torch.optim's step hooks, compiler/eager_fusion.py): begin holds the current stream of each
// device in use, end lets every held run go.
void mark_run(bool begin);
bool on_stream_worker();  // this thread runs a stream's kernels (it never parks at exit, nor waits to launch)
StreamQueue& queue_of(c10::DeviceIndex device, c10::StreamId id);
StreamQueue& current_queue(c10::DeviceIndex device);
std::vector<StreamQueue*> queues_of(c10::DeviceIndex device);  // -1: every device
// Wait for every stream of `device` (-1: all devices); `raise`: then raise the first pending kernel error.
void synchronize_device(c10::DeviceIndex device, bool raise = true);
// A host-side use of device memory on the current stream (a blocking copy, an op run on the host thread): wait
// for the stream's queued work and raise its pending error.
void drain_current(c10::DeviceIndex device);
void reset_queues_after_fork();  // a forked child's queues: empty, no workers (the parent's work is the parent's)

}  // namespace torchneuron
