// Device guard, streams and events of the modelled NeuronCores.
// Each stream is an in-order queue run by its own worker (queue.cpp). An event recorded on a stream is a marker in
// its queue: it completes, and takes its timestamp, when the stream's worker reaches it, so the elapsed time between
// two events is device execution time. Waiting on an event queues a wait on the waiting stream (its worker blocks
// until the event's stream reaches the marker); synchronizing blocks the host. Streams, events and synchronisations
// are reported to the stream checker (stream_trace.cpp) in program order, which is what it checks.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <chrono>

#include "runtime.h"

namespace torchneuron {
namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
using c10::StreamId;

constexpr int kPoolSize = 32;  // streams handed out by getStreamFromGlobalPool, per priority

// Shared with the marker task in the queue: the event may be destroyed before its stream reaches it.
struct Marker {
  std::atomic<int64_t> when_ns{0};
};

struct Event {
  DeviceIndex device;
  c10::EventFlag flag;
  StreamQueue* queue = nullptr;  // where it was last recorded (null: never)
  uint64_t ticket = 0;
  std::shared_ptr<Marker> marker = std::make_shared<Marker>();
  bool done() const { return !queue || queue->query(ticket); }
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::array<std::atomic<StreamId>, 128> g_next_stream{};  // per device; ids > 2*kPoolSize are fresh streams
std::array<std::atomic<int>, 128> g_pool_cursor{};
thread_local std::array<StreamId, 128> t_stream{};  // current stream per device, 0 = default stream

// A device without an index (torch.Stream(device="neuron")) means the current device.
DeviceIndex index_of(Device d) {
  DeviceIndex i = d.index() < 0 ? current_device() : d.index();
  check_device_index(i);
  return i;
}

struct NeuronGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNeuron; }

  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(kNeuron, current_device()); }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.type() == kNeuron, "expected a neuron device, got ", d);
    set_current_device(d.index());
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) set_current_device(d.index());
  }

  Stream make(DeviceIndex dev, StreamId id) const { return Stream(Stream::UNSAFE, Device(kNeuron, dev), id); }
  Stream getStream(Device d) const override {
    DeviceIndex i = index_of(d);
    return make(i, t_stream[i]);
  }
  Stream getDefaultStream(Device d) const override { return make(index_of(d), 0); }
  Stream getStreamFromGlobalPool(Device d, bool high) const override {
    DeviceIndex i = index_of(d);
    int slot = g_pool_cursor[i]++ % kPoolSize;
    Stream s = make(i, 1 + slot + (high ? kPoolSize : 0));
    trace_stream_creation(s);
    return s;
  }
  Stream getNewStream(Device d, int priority) const override {
    DeviceIndex i = index_of(d);
    Stream s = make(i, 1 + 2 * kPoolSize + g_next_stream[i]++);
    trace_stream_creation(s);
    return s;
  }
  Stream exchangeStream(Stream s) const override {
    check_device_index(s.device_index());
    Stream old = getStream(s.device());
    t_stream[s.device_index()] = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return device_count(); }

  void record(void** event, const Stream& stream, const DeviceIndex device, const c10::EventFlag flag) const override {
    TORCH_CHECK(device < 0 || device == stream.device_index(), "Event device index ", static_cast<int>(device),
                " does not match the recording stream's device ", stream.device());
    auto* e = static_cast<Event*>(*event);
    if (!e) {
      *event = e = new Event{stream.device_index(), flag};
      trace_event_creation(e);
    }
    StreamQueue& q = queue_of(stream.device_index(), stream.id());
    e->marker = std::make_shared<Marker>();  // a re-record must not be completed by the previous marker
    e->queue = &q;
    if (q.idle() || g_launch_blocking.load(std::memory_order_relaxed)) {
      e->marker->when_ns = now_ns();  // nothing queued: the stream is at this point now
      e->ticket = q.enqueued();
    } else {
      e->ticket = q.push("event record", [m = e->marker] { m->when_ns = now_ns(); }, /*control=*/true);
    }
    trace_event_record(e, stream);
  }
  // `stream` waits for the work recorded before the event (an event never recorded orders nothing, as CUDA's).
  void block(void* event, const Stream& stream) const override {
    trace_event_wait(event, stream);
    auto* e = static_cast<Event*>(event);
    if (!e || !e->queue) return;
    StreamQueue& q = queue_of(stream.device_index(), stream.id());
    if (&q == e->queue) return;  // in order already
    if (e->done()) {             // nothing to wait for, but a failure behind the event surfaces here too (waits chain)
      for (FailurePtr& f : e->queue->unreported_failures(e->ticket)) q.take_failure(std::move(f), q.enqueued());
      return;
    }
    q.push(
        "event wait",
        [src = e->queue, t = e->ticket, &q] {
          src->wait_quiet(t);
          for (FailurePtr& f : src->unreported_failures(t)) q.take_failure(std::move(f), q.running());
        },
        /*control=*/true);
  }
  bool queryEvent(void* event) const override { return !event || static_cast<Event*>(event)->done(); }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    trace_event_deletion(event);
    delete static_cast<Event*>(event);
  }
  void synchronizeEvent(void* event) const override {
    auto* e = static_cast<Event*>(event);
    if (e && e->queue) e->queue->wait(e->ticket);
    trace_event_synchronization(event);
  }
  double elapsedTime(void* a, void* b, const DeviceIndex) const override {
    auto* s = static_cast<Event*>(a);
    auto* e = static_cast<Event*>(b);
    TORCH_CHECK(s && e && s->queue && e->queue,
                "elapsed_time needs both events to have been recorded; call record() on each first");
    TORCH_CHECK(s->flag == c10::EventFlag::BACKEND_DEFAULT && e->flag == c10::EventFlag::BACKEND_DEFAULT,
                "Both events must be created with argument 'enable_timing=True'.");
    TORCH_CHECK(s->done() && e->done(),
                "elapsed_time: an event has not completed yet (the device is still "
                "running the work before it); call end_event.synchronize() or torch.neuron.synchronize() first");
    return static_cast<double>(e->marker->when_ns.load() - s->marker->when_ns.load()) / 1e6;
  }

  bool queryStream(const Stream& s) const override {
    StreamQueue& q = queue_of(s.device_index(), s.id());
    return q.query(q.enqueued());
  }
  void synchronizeStream(const Stream& s) const override {
    StreamQueue& q = queue_of(s.device_index(), s.id());
    q.wait(q.enqueued());
    trace_stream_synchronization(s);
  }
  void synchronizeDevice(const DeviceIndex device) const override {
    if (device >= 0) check_device_index(device);
    synchronize_device(device);
    trace_device_synchronization();
  }
  void recordDataPtrOnStream(const c10::DataPtr& ptr, const Stream& s) const override {
    neuron_allocator()->recordStream(ptr, s);
  }
};

// Tensor.record_stream (a CUDA-only kernel in ATen): the block's use on `s` goes to the allocator, which then
// reuses the block only after `s` has run the work queued so far.
void record_stream(at::Tensor& self, c10::Stream s) { neuron_allocator()->recordStream(self.storage().data_ptr(), s); }

}  // namespace

StreamId current_stream_id(DeviceIndex device) { return t_stream[device]; }

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl)

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) { m.impl("record_stream", record_stream); }

}  // namespace torchneuron
