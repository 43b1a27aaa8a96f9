// The device boundary of compiled kernels (torchneuron/compiler/kernel.py): a kernel generated for the host takes
// CPU views of its neuron inputs and its results' memory is adopted into neuron memory. These two calls run for
// every tensor of every compiled graph call, so they are C++ (a Python loop cost ~7 us per tensor).
#include <torch/extension.h>

#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "runtime.h"

namespace torchneuron {
namespace {

// Address of a tensor's memory block; 0 for an empty tensor (it owns nothing worth adopting).
const void* base_ptr(const at::Tensor& t) { return t.numel() ? t.storage().data() : nullptr; }

// Replace args[i] (a neuron tensor) with a CPU view of the same memory, for each i in `device_inputs`. Inputs over
// one device storage share one CPU storage, so the kernel sees them alias as they do.
// `wait`: first wait for the current stream's queued work (the kernel then runs on this thread, now); a queued
// kernel's views are made at its launch, without waiting.
void host_args(py::list args, const std::vector<int64_t>& device_inputs, bool wait) {
  if (wait && !device_inputs.empty()) drain_current(py::cast<at::Tensor>(args[device_inputs[0]]).device().index());
  Access reads;
  for (int64_t i : device_inputs) reads.push_back(touch(py::cast<at::Tensor>(args[i]), true, false));
  raise_if_poisoned(reads, "a compiled kernel");  // its inputs were never computed: raised at the call
  HostAliases host;
  for (int64_t i : device_inputs) args[i] = py::cast(host(py::cast<at::Tensor>(args[i])));
}

// The kernel's results on the device. `devices[i]` is the neuron index of result i, or None to keep it as is.
// A result over input memory becomes a view of that input; fresh memory is adopted without a copy when only the
// results reference it (several results may share one buffer), else copied; later results over memory already
// adopted whole become views of it; the same result object twice stays one tensor.
py::list device_results(py::sequence outs, const std::vector<std::optional<int64_t>>& devices,
                        const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(py::len(outs) == devices.size(), "neuron: kernel returned ", py::len(outs), " results, expected ",
              devices.size());
  std::unordered_map<const void*, at::Tensor> owners;
  for (const auto& t : inputs) owners.emplace(base_ptr(t), t);
  std::vector<std::optional<at::Tensor>> host(devices.size());
  std::vector<const void*> ptrs(devices.size());  // read before any adoption empties a storage
  std::unordered_map<const void*, std::vector<const c10::TensorImpl*>> holders;  // memory -> distinct results
  for (size_t i = 0; i < devices.size(); ++i) {
    py::handle o = outs[i];
    if (!devices[i] || !THPVariable_Check(o.ptr())) continue;
    host[i] = THPVariable_Unpack(o.ptr());
    ptrs[i] = base_ptr(*host[i]);
    auto& h = holders[ptrs[i]];
    auto* impl = host[i]->unsafeGetTensorImpl();
    if (std::find(h.begin(), h.end(), impl) == h.end()) h.push_back(impl);
  }
  py::list res(devices.size());
  std::unordered_map<const c10::TensorImpl*, at::Tensor> done;
  for (size_t i = 0; i < devices.size(); ++i) {
    if (!host[i]) {
      res[i] = outs[i];
      continue;
    }
    const at::Tensor& o = *host[i];
    const auto dev = static_cast<c10::DeviceIndex>(*devices[i]);
    const void* ptr = ptrs[i];
    at::Tensor out;
    if (auto it = done.find(o.unsafeGetTensorImpl()); it != done.end()) {
      out = it->second;
    } else if (!ptr) {
      out = at::empty_strided(o.sizes(), o.strides(), o.options().device(c10::Device(kNeuron, dev)));
    } else if (auto own = owners.find(ptr); own != owners.end()) {
      out = device_tensor_like(own->second.storage(), o);
    } else {
      bool shared = static_cast<size_t>(o.storage().use_count()) > holders[ptr].size() || !o.storage().resizable();
      out = adopt_host_tensor(shared ? o.clone() : o, dev);
      if (!shared) {
        o.unsafeGetTensorImpl()->set_sizes_contiguous({0});  // the CPU result is left empty, never dangling
        owners.emplace(ptr, out);                            // the memory moved whole
      }
    }
    done.emplace(o.unsafeGetTensorImpl(), out);
    res[i] = py::cast(out);
  }
  return res;
}

// A queued compiled kernel's result at its launch: a neuron tensor (not a view) with this metadata over `base`'s
// storage, which the kernel fills when it runs.
at::Tensor tensor_over(const at::Tensor& base, at::ScalarType dtype, const std::vector<int64_t>& sizes,
                       const std::vector<int64_t>& strides, int64_t offset) {
  TORCH_CHECK(base.device().type() == kNeuron, "_tensor_over expects a neuron tensor, got one on ", base.device());
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()),
                                                    c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                    c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  int64_t end = offset + 1;  // one past the last element (an empty tensor needs no memory)
  for (size_t d = 0; d < sizes.size(); ++d) end = sizes[d] == 0 ? 0 : end + (sizes[d] - 1) * strides[d];
  TORCH_CHECK(end == 0 || static_cast<size_t>(end) * c10::elementSize(dtype) <= base.storage().nbytes(),
              "_tensor_over: sizes ", sizes, ", strides ", strides, " and offset ", offset, " reach past the ",
              base.storage().nbytes(), " bytes of the storage");
  return t;
}

// Queue `run()` (a compiled kernel's call over host views) on the current stream of `device`. The stream worker
// runs it holding the GIL: the kernel's generated code is Python, and the loops it calls release the GIL.
void queue_kernel(c10::DeviceIndex device, const std::string& name, py::object run, int64_t work,
                  const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes) {
  Access acc;
  for (const at::Tensor& t : reads) acc.push_back(touch(t, true, false));
  for (const at::Tensor& t : writes) acc.push_back(touch(t, false, true));
  static std::mutex mu;
  static auto* names = new std::unordered_set<std::string>;  // a task's name lives as long as the process
  const char* label;
  {
    std::lock_guard<std::mutex> g(mu);
    label = names->insert(name).first->c_str();
  }
  std::shared_ptr<py::object> fn(new py::object(std::move(run)), [](py::object* o) {
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      py::gil_scoped_acquire gil;  // the worker drops the call's references (and its views) under the GIL
      delete o;
    } else {
      o->release();  // the interpreter is gone: leak rather than touch it
      delete o;
    }
  });
  current_queue(device).push(
      label,
      [fn] {
        if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
        py::gil_scoped_acquire gil;
        try {
          (*fn)();
        } catch (py::error_already_set& e) {  // reported at the stream's next sync point, with the op's name
          throw std::runtime_error(e.what());
        }
      },
      false, nullptr, work, std::move(acc));
}

}  // namespace

void bind_boundary(py::module_& m) {
  m.def("_host_args", &host_args, py::arg("args"), py::arg("device_inputs"), py::arg("wait") = true,
        "Replace the neuron tensors args[i], i in device_inputs, by CPU views of them (after the current stream's "
        "queued work, unless wait=False).");
  m.def("_tensor_over", &tensor_over, py::arg("base"), py::arg("dtype"), py::arg("sizes"), py::arg("strides"),
        py::arg("offset"), "A neuron tensor (not a view) with this metadata over base's storage.");
  m.def("_queue_kernel", &queue_kernel, py::arg("device"), py::arg("name"), py::arg("run"), py::arg("work"),
        py::arg("reads"), py::arg("writes"),
        "Queue run() on the current stream of a neuron device; the stream's worker calls it holding the GIL. "
        "`reads`/`writes`: the neuron tensors it reads and writes (skipped, and its writes poisoned, when a read "
        "was never computed).");
  m.def("_device_results", &device_results, py::arg("outs"), py::arg("devices"), py::arg("inputs"),
        "A compiled kernel's CPU results as neuron tensors: views of `inputs` where they alias them, else adopted "
        "(no copy unless something besides the results holds the memory).");
}

}  // namespace torchneuron
