// Composite routing: which aten ops the fallback takes although ATen has a kernel the device could use
// (runtime.h, route_to_cpu_kernels). Registered once, from _C._init.
#include <torch/library.h>

#include <memory>
#include <unordered_set>

#include "runtime.h"

namespace torchneuron {
namespace {

// Composite kernels that refuse every device but CPU/CUDA/XPU (a device-type TORCH_CHECK in ATen; the list comes
// from searching ATen's sources and messages, see docs/device.md). Routed through the fallback, the CPU's entry runs
// the same composite on the host aliases, where the check passes. A fact about ATen's kernels, not an op class.
const std::unordered_set<std::string> kDeviceCheckedComposites = {"mode.values"};

}  // namespace

int route_to_cpu_kernels() {
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
    if (!kDeviceCheckedComposites.count(n_) &&
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
