// The device boundary of compiled kernels (torchneuron/compiler/kernel.py): a kernel generated for the host takes
// CPU views of its neuron inputs and its results' memory is adopted into neuron memory. These two calls run for
// every tensor of every compiled graph call, so they are C++ (a Python loop cost ~7 us per tensor).
#include <torch/extension.h>

#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "fallback.h"
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

// A compiled kernel's queued results: its first call's neuron results learnt as an op's are (fallback.h), and handed
// out at each later launch over its neuron inputs and fresh storages (returned as byte tensors: the generated code
// allocates its buffers in them, compiler/kernel.py).
using Layout = fallback::ResultLayout;
std::shared_ptr<Layout> learn_results(const std::vector<std::optional<at::Tensor>>& results,
                                      const std::vector<at::Tensor>& inputs) {
  fallback::FlatArgs flat(inputs.begin(), inputs.end());
  return std::const_pointer_cast<Layout>(fallback::record_results(results, flat));
}

std::pair<std::vector<std::optional<at::Tensor>>, std::vector<at::Tensor>> hand_out_results(
    const Layout& L, const std::vector<at::Tensor>& inputs, c10::DeviceIndex device) {
  c10::DeviceGuard guard(c10::Device(kNeuron, device));
  fallback::FlatArgs flat(inputs.begin(), inputs.end());
  std::vector<c10::Storage> groups;
  std::vector<std::optional<at::Tensor>> results;
  for (at::Tensor& r : fallback::hand_out(L, flat, groups))
    results.push_back(r.defined() ? std::optional<at::Tensor>(std::move(r)) : std::nullopt);
  std::vector<at::Tensor> bytes;
  for (c10::Storage& g : groups) {
    auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(g), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                      c10::scalarTypeToTypeMeta(at::kByte));
    t.unsafeGetTensorImpl()->set_sizes_contiguous({static_cast<int64_t>(t.storage().nbytes())});
    bytes.push_back(std::move(t));
  }
  return {std::move(results), std::move(bytes)};
}

}  // namespace

void bind_boundary(py::module_& m) {
  py::class_<Layout, std::shared_ptr<Layout>>(m, "ResultLayout",
                                              "Where each result of a compiled kernel's first call lived.")
      .def_property_readonly(
          "slot_groups",
          [](const Layout& L) {
            std::vector<int> v;
            for (const auto& s : L.slots) v.push_back(s.kind == fallback::ResultSlot::fresh ? s.source : -1);
            return v;
          },
          "Per result: the fresh storage (group) it lives in, or -1 (over an input, or None).");
  m.def("_learn_results", &learn_results, py::arg("results"), py::arg("inputs"),
        "The layout of a compiled kernel's neuron results against its neuron inputs, or None when a later call "
        "could not be handed them at its launch.");
  m.def("_hand_out_results", &hand_out_results, py::arg("layout"), py::arg("inputs"), py::arg("device"),
        "A queued call's results in `layout` over `inputs`, and its fresh storages as byte tensors.");
  m.def("_host_args", &host_args, py::arg("args"), py::arg("device_inputs"), py::arg("wait") = true,
        "Replace the neuron tensors args[i], i in device_inputs, by CPU views of them (after the current stream's "
        "queued work, unless wait=False).");
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
