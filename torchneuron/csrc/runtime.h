// The modelled NeuronCore runtime shared by the C++ core: device table, current device, policies,
// and the few entry points the files call across each other. One concern per .cpp file.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace torchneuron {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// ---- runtime.cpp: the modelled device table ----
void configure_devices(const std::vector<int64_t>& capacities);  // one entry per visible logical core
c10::DeviceIndex device_count() noexcept;
int64_t device_capacity(c10::DeviceIndex index);
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);  // validates the index
void check_device_index(c10::DeviceIndex index);  // throws torch.AcceleratorError (as CUDA) naming the valid range

// ---- allocator.cpp: caching device allocator with capacity ----
c10::DeviceAllocator* neuron_allocator();
// Take ownership of host memory a CPU kernel produced for a device tensor (no copy; it is counted as device
// memory from now on and released to the host allocator when freed).
c10::DataPtr adopt_host_memory(c10::DataPtr host, size_t nbytes, c10::DeviceIndex device);
// The device whose memory contains `ptr`, or -1.
c10::DeviceIndex device_of_pointer(const void* ptr);

// ---- hooks.cpp: hooks and generators ----
void register_hooks();
const at::Generator& default_generator(c10::DeviceIndex index);
// The CPU generator that draws the numbers for a neuron generator (the CPU kernels require a CPU generator).
at::Generator host_generator_of(const at::Generator& neuron_gen);

// ---- fallback.cpp: policies and op tracking ----
enum class DtypePolicy : int { trainium = 0, host = 1 };
enum class FallbackPolicy : int { warn = 0, silent = 1, error = 2 };
void set_policies(DtypePolicy dtype, FallbackPolicy fallback);
// native: ops the device runs (the rest are counted as host fallbacks); exact: data movement that keeps fp64 bits.
void set_op_tables(const std::vector<std::string>& native, const std::vector<std::string>& exact);
void note_executed(const char* name);              // an explicit kernel ran on the device
void note_host_to_device(const at::Tensor& host);  // data entered the device: apply the dtype policy
void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// Ops with both a CPU kernel and a device-generic composite kernel would take the composite on `neuron`
// (a different algorithm, different rounding, and an extra out= round trip). Route them to the CPU kernel
// through the fallback instead, so the device computes exactly what the CPU does; likewise the composites ATen
// guards with a device-type check that excludes PrivateUse1 (mode.values). Returns how many.
int route_to_cpu_kernels();
// (name, count) pairs
std::vector<std::pair<std::string, int64_t>> executed_ops();
std::vector<std::pair<std::string, int64_t>> fallback_ops();
std::vector<std::pair<std::string, int64_t>> dtype_events();
void clear_op_tracking();

// ---- shared helpers (kernels.cpp) ----
// A CPU tensor that aliases the device tensor's memory (same bytes, sizes, strides, offset): the zero-copy
// bridge onto ATen CPU kernels.
at::Tensor host_alias(const at::Tensor& device_tensor);
// A device tensor over the memory of a CPU tensor produced by a kernel (adopted, no copy).
at::Tensor adopt_host_tensor(const at::Tensor& host, c10::DeviceIndex device);
// A neuron tensor over `storage` with the metadata (and conj/neg bits) of `like`.
at::Tensor device_tensor_like(const c10::Storage& storage, const at::Tensor& like);

}  // namespace torchneuron
