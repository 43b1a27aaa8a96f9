// The device's stream, event and memory events for the stream checker (torch.neuron.stream_check), sent the way
// CUDA's guard and allocator send theirs: through c10's GPU trace, which PyTorch routes by device type to
// torch.<backend>._gpu_trace (torch/csrc/PyInterpreter.cpp), here torch.neuron._gpu_trace. Until
// the checker turns the trace on (torch.ops.torchneuron._stream_trace(True), after torch._C._activate_gpu_trace()),
// each call is one relaxed load and branch; PyTorch cannot deactivate its trace, so disable() turns ours off. The
// trace takes the GIL: call these with no allocator lock held.
#include <c10/core/impl/GPUTrace.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <atomic>

#include "runtime.h"

namespace torchneuron {
namespace {

std::atomic<bool> g_on{false};
uintptr_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// Sends one event with the GIL held and Python's error indicator set aside: a tensor can be freed while an exception
// propagates (a temporary dies during unwinding), and the trace's Python code must neither see nor clear it.
template <class F>
void emit(F&& send) {
  if (!g_on.load(std::memory_order_relaxed)) return;
  if (auto* t = c10::impl::GPUTrace::get_trace(); t && Py_IsInitialized()) {
    pybind11::gil_scoped_acquire gil;
    pybind11::error_scope keep;
    send(**t);
  }
}

}  // namespace

uintptr_t stream_trace_key(const c10::Stream& s) {
  return (static_cast<uintptr_t>(s.id()) << 8) | static_cast<uint8_t>(s.device_index());
}

using Trace = const c10::impl::PyInterpreterVTable&;
void trace_event_creation(const void* event) {
  emit([&](Trace t) { t.trace_gpu_event_creation(kNeuron, addr(event)); });
}
void trace_event_deletion(const void* event) {
  if (event) emit([&](Trace t) { t.trace_gpu_event_deletion(kNeuron, addr(event)); });
}
void trace_event_record(const void* event, const c10::Stream& s) {
  emit([&](Trace t) { t.trace_gpu_event_record(kNeuron, addr(event), stream_trace_key(s)); });
}
void trace_event_wait(const void* event, const c10::Stream& s) {
  if (event) emit([&](Trace t) { t.trace_gpu_event_wait(kNeuron, addr(event), stream_trace_key(s)); });
}
void trace_event_synchronization(const void* event) {
  if (event) emit([&](Trace t) { t.trace_gpu_event_synchronization(kNeuron, addr(event)); });
}
void trace_stream_creation(const c10::Stream& s) {
  emit([&](Trace t) { t.trace_gpu_stream_creation(kNeuron, stream_trace_key(s)); });
}
void trace_stream_synchronization(const c10::Stream& s) {
  emit([&](Trace t) { t.trace_gpu_stream_synchronization(kNeuron, stream_trace_key(s)); });
}
void trace_device_synchronization() {
  emit([&](Trace t) { t.trace_gpu_device_synchronization(kNeuron); });
}
void trace_memory_allocation(const void* ptr) {
  if (ptr) emit([&](Trace t) { t.trace_gpu_memory_allocation(kNeuron, addr(ptr)); });
}
void trace_memory_deallocation(const void* ptr) {
  if (ptr) emit([&](Trace t) { t.trace_gpu_memory_deallocation(kNeuron, addr(ptr)); });
}

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("_stream_trace(bool on) -> ()", [](bool on) { g_on.store(on, std::memory_order_relaxed); });
}

}  // namespace torchneuron
