// The device table of the modelled machine: how many logical NeuronCores this process sees, each one's
// memory capacity, and the calling thread's current device. Configured once from Python (_C._init, from the
// configuration).
#include "runtime.h"

#include <c10/util/Exception.h>

namespace torchneuron {
namespace {
std::vector<int64_t> g_capacity;  // written once at registration, read-only afterwards
std::string g_unavailable;        // why no device is usable (an invalid configuration), or empty
thread_local c10::DeviceIndex t_current = 0;
}  // namespace

void configure_devices(const std::vector<int64_t>& capacities, const std::string& unavailable) {
  TORCH_CHECK(unavailable.empty() ? !capacities.empty() && capacities.size() <= 127 : capacities.empty(),
              "neuron: between 1 and 127 visible cores are supported, got ", capacities.size());
  g_capacity = capacities;
  g_unavailable = unavailable;
}

c10::DeviceIndex device_count() noexcept { return static_cast<c10::DeviceIndex>(g_capacity.size()); }

// CUDA reports an invalid ordinal as torch.AcceleratorError (a RuntimeError) with cudaErrorInvalidDevice's code.
void check_device_index(c10::DeviceIndex index) {
  TORCH_CHECK(g_unavailable.empty(), g_unavailable);  // RuntimeError, as CUDA's failed initialisation
  if (index >= 0 && index < device_count()) return;
  throw c10::AcceleratorError(
      {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, /*cudaErrorInvalidDevice*/ 101,
      c10::str("neuron error: invalid device ordinal ", static_cast<int>(index), ": this process sees ",
               static_cast<int>(device_count()), " neuron device(s), valid indices are 0..",
               static_cast<int>(device_count()) - 1, " (see NEURON_RT_VISIBLE_CORES and TORCHNEURON_INSTANCE)"));
}

int64_t device_capacity(c10::DeviceIndex index) {
  check_device_index(index);
  return g_capacity[index];
}

c10::DeviceIndex current_device() { return t_current; }

void set_current_device(c10::DeviceIndex index) {
  check_device_index(index);
  t_current = index;
}

}  // namespace torchneuron
