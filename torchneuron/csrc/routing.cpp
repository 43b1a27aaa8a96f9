// Composite routing: which aten ops the fallback takes although ATen has a kernel the device could use
// (runtime.h, route_to_cpu_kernels). Registered once, from _C._init.
#include <torch/library.h>

#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "runtime.h"

namespace torchneuron {

// `device_checked`: composites that refuse every device but CPU/CUDA/XPU (a device-type TORCH_CHECK in ATen), as
// "name.overload", from the op table (runtime/optable.py, `device_checked`). Routed through the fallback, the CPU's
// entry runs the same composite on the host aliases, where the check passes.
// `one_kernel`: list ops (base names) the device runs as one kernel, as CUDA's multi-tensor kernels: routed, the
// CPU's entry runs ATen's list op (its per-tensor loop) on the host aliases, one launch in all. Not the overloads
// taking a `Tensor scalars` argument: that one is a host tensor, which the fallback refuses beside device lists.
bool takes_host_scalars(const c10::FunctionSchema& schema) {
  for (const auto& a : schema.arguments())
    if (a.name() == "scalars" && a.type()->kind() == c10::TypeKind::TensorType) return true;
  return false;
}

int route_to_cpu_kernels(const std::vector<std::string>& device_checked, const std::vector<std::string>& one_kernel) {
  const std::unordered_set<std::string> checked(device_checked.begin(), device_checked.end());
  const std::unordered_set<std::string> whole(one_kernel.begin(), one_kernel.end());
  static std::unique_ptr<torch::Library> lib;
  if (lib) return -1;
  lib =
      std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  int n = 0;
  auto& d = c10::Dispatcher::singleton();
  for (const auto& name : d.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = d.findOp(name);
    std::string n_ = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    const bool list_op = whole.count(base_name(name.name)) && !takes_host_scalars(op->schema());
    if (!checked.count(n_) && !list_op &&
        (!op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
         !(op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
           op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))))
      continue;
    lib->impl(n_.c_str(), torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>());
    ++n;
  }
  return n;
}

}  // namespace torchneuron
