// Out of device memory: torch.OutOfMemoryError worded as CUDA's (the request, the capacity, what PyTorch has
// allocated and reserved, the per-process fraction), and a host allocation failure inside a device kernel mapped
// to it, so a user's OOM handling (catch, lower the batch size, retry) works unchanged.
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "runtime.h"

namespace torchneuron {
namespace {

std::string fmt_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  char buf[32];
  snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", b, units[u]);
  return buf;
}

}  // namespace

void throw_device_oom(const OomReport& r, const char* why) {
  std::string frac = r.fraction < 1.0 ? "; the per-process memory fraction " + c10::str(r.fraction) +
                                            " limits this process to " + fmt_bytes(static_cast<double>(r.limit)) +
                                            " (torch.neuron.set_per_process_memory_fraction)"
                                      : "";
  TORCH_CHECK_WITH(OutOfMemoryError, false, "neuron:", static_cast<int>(r.device), " out of memory: tried to allocate ",
                   fmt_bytes(static_cast<double>(r.requested)), " (", r.requested,
                   " bytes); the device has a capacity of ", fmt_bytes(static_cast<double>(r.capacity)), frac,
                   ", of which ", fmt_bytes(static_cast<double>(r.allocated)), " is allocated by PyTorch and ",
                   fmt_bytes(static_cast<double>(r.reserved)), " reserved. ",
                   why ? why
                       : "Free tensors, lower the batch size, or model a larger core "
                         "(TORCHNEURON_MEMORY_LIMIT / TORCHNEURON_INSTANCE).");
}

bool is_host_oom(const c10::Error& e) { return e.msg().find("DefaultCPUAllocator") != std::string::npos; }

void throw_host_oom(c10::DeviceIndex device, const c10::Error& host_error) {
  const std::string& msg = host_error.msg();
  const std::string tried = "tried to allocate ";  // "... you tried to allocate N bytes"
  auto at = msg.find(tried);
  size_t requested = at == std::string::npos ? 0 : std::strtoull(msg.c_str() + at + tried.size(), nullptr, 10);
  raise_host_oom(
      device, requested,
      "The host could not provide the memory for the kernel's result (" + msg.substr(0, msg.find('\n')) + ").");
}

}  // namespace torchneuron
