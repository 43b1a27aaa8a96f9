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
int route_to_cpu_kernels(const std::vector<std::string>& device_checked) {
  const std::unordered_set<std::string> checked(device_checked.begin(), device_checked.end());
  static std::unique_ptr<torch::Library> lib;
  if (lib) return -1;
  lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  int n = 0;
  auto& d = c10::Dispatcher::singleton();
  for (const auto& name : d.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = d.findOp(name);
    std::string n_ = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    if (!checked.count(n_) &&
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
