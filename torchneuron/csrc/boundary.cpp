// The device boundary of compiled kernels (torchneuron/compiler/kernel.py): a kernel generated for the host takes
// CPU views of its neuron inputs and its results' memory is adopted into neuron memory. These two calls run for
// every tensor of every compiled graph call, so they are C++ (a Python loop cost ~7 us per tensor).
#include <torch/extension.h>

#include <unordered_map>

#include "runtime.h"

namespace torchneuron {
namespace {

// Address of a tensor's memory block; 0 for an empty tensor (it owns nothing worth adopting).
const void* base_ptr(const at::Tensor& t) { return t.numel() ? t.storage().data() : nullptr; }

// Replace args[i] (a neuron tensor) with a CPU view of the same memory, for each i in `device_inputs`. Inputs over
// one device storage share one CPU storage, so the kernel sees them alias as they do.
void host_args(py::list args, const std::vector<int64_t>& device_inputs) {
  if (!device_inputs.empty()) drain_current(py::cast<at::Tensor>(args[device_inputs[0]]).device().index());
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
        owners.emplace(ptr, out);                           // the memory moved whole
      }
    }
    done.emplace(o.unsafeGetTensorImpl(), out);
    res[i] = py::cast(out);
  }
  return res;
}

}  // namespace

void bind_boundary(py::module_& m) {
  m.def("_host_args", &host_args, "Replace the neuron tensors args[i], i in device_inputs, by CPU views of them.");
  m.def("_device_results", &device_results, py::arg("outs"), py::arg("devices"), py::arg("inputs"),
        "A compiled kernel's CPU results as neuron tensors: views of `inputs` where they alias them, else adopted "
        "(no copy unless something besides the results holds the memory).");
}

}  // namespace torchneuron
