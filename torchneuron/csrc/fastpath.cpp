// Unboxed fast paths for the hot functional pointwise ops. The boxed fallback (fallback.cpp) pays for its
// generality on every call: boxing the arguments, an argument signature, a layout look-up, the CPU kernel's own
// output allocation and its adoption into device memory, then mapping the results back. For a tiny op on an idle
// stream that is most of its cost. These ops are structured kernels: their CPU `meta` computes the result's shape,
// dtype and strides (the same code the CPU's functional kernel runs), `impl` computes it; the result is allocated
// in device memory at once (a cached block, nothing adopted). Two ways to run them:
// - direct: `meta` and `impl` over the device tensors themselves, `impl` reaching the CPU's kernel through the
//   op's DispatchStub, whose PrivateUse1 entry is routed to the CPU's (device memory is host memory). Taken when
//   every tensor is a neuron tensor and all share one floating dtype, which is then the result's: TensorIterator
//   converts operands to the common dtype only when that device is the CPU, so mixed dtypes must not come here.
// - aliased: the same over host aliases of the arguments (CPU tensors on the same bytes), `impl` writing the
//   result through its alias: everything else (integers, mixed dtypes, CPU values), and GELU, whose CPU kernel
//   takes oneDNN's path only for CPU tensors (so the direct one would round differently from the CPU).
// Either way the result is the CPU kernel's exact one, with no boxing and no result mapping.
//
// Only the plain case takes a fast path: every tensor a neuron tensor of one device or a 0-dim CPU value, the
// stream idle and the result small (where the boxed path runs the op inline as well), launches not blocking, no
// profiler trace, and no float64 device tensor under the trainium rules. Everything else -- queued launches, device
// mismatches and their messages, the fp64 rules -- is the boxed fallback's, called with the same arguments, so
// behaviour is the fallback's by construction. The fast path keeps the rest of it: op counting and the fallback
// policy, the pending kernel error of the stream, the device OOM mapping, and the trainium rules on the result
// (int64 range, float64 rounding).
//
// The stubs' exported look-up takes one kernel per CPU capability the wheel was built with; on x86-64 those are
// AVX512 and AVX2 (the declarations must match, or the symbol is not found). Elsewhere only the aliased path runs.
#if defined(__x86_64__)
#define HAVE_AVX512_CPU_DEFINITION
#define HAVE_AVX2_CPU_DEFINITION
#define TORCHNEURON_DIRECT_STUBS 1
#else
#define TORCHNEURON_DIRECT_STUBS 0
#endif
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <ATen/ops/add_native.h>
#include <ATen/ops/div_native.h>
#include <ATen/ops/exp_native.h>
#include <ATen/ops/gelu_backward_native.h>
#include <ATen/ops/gelu_native.h>
#include <ATen/ops/log_native.h>
#include <ATen/ops/maximum_native.h>
#include <ATen/ops/minimum_native.h>
#include <ATen/ops/mul_native.h>
#include <ATen/ops/neg_native.h>
#include <ATen/ops/pow_native.h>
#include <ATen/ops/rsqrt_native.h>
#include <ATen/ops/sigmoid_backward_native.h>
#include <ATen/ops/sigmoid_native.h>
#include <ATen/ops/silu_backward_native.h>
#include <ATen/ops/silu_native.h>
#include <ATen/ops/sqrt_native.h>
#include <ATen/ops/sub_native.h>
#include <ATen/ops/tanh_backward_native.h>
#include <ATen/ops/tanh_native.h>
#include <ATen/ops/threshold_backward_native.h>
#include <ATen/native/Activation.h>
#include <ATen/native/BinaryOps.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/Pow.h>
#include <ATen/native/UnaryOps.h>
#include <torch/library.h>

#include <array>
#include <tuple>

#include "runtime.h"

namespace torchneuron {
namespace {

// A CPU storage over a device storage's bytes, from the thread's recent ones when it can: the caching allocator
// hands the same blocks out again, so most calls find theirs here instead of making a StorageImpl per tensor. Only
// one nothing else holds is reused, over the same bytes, so it is exactly the alias a fresh one would be.
c10::Storage host_storage(const c10::Storage& device) {
  struct Entry {
    const void* data = nullptr;
    size_t nbytes = 0;
    c10::Storage host;
  };
  thread_local std::array<Entry, 8> recent;
  thread_local size_t next = 0;
  const void* data = device.data();
  const size_t nbytes = device.nbytes();
  for (auto& e : recent)
    if (e.data == data && e.nbytes == nbytes && e.host.use_count() == 1 && e.host.data() == data &&
        e.host.nbytes() == nbytes)
      return e.host;
  c10::Storage host(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                          c10::DataPtr(device.mutable_data(), c10::Device(c10::kCPU)),
                                                          c10::GetCPUAllocator(), /*resizable=*/true));
  if (nbytes) recent[next++ % recent.size()] = {data, nbytes, host};  // empty storages: one each (overlap checks)
  return host;
}

// A structured kernel's result in device memory, as the CPU's functional wrapper allocates it: in the options'
// memory format unless TensorIterator gives strides.
at::Tensor device_result(at::IntArrayRef sizes, at::IntArrayRef strides, const at::TensorOptions& options) {
  const auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  const auto dtype = options.dtype().toScalarType();
  return strides.empty()
             ? at::detail::empty_generic(sizes, neuron_allocator(), keys, dtype, options.memory_format_opt())
             : at::detail::empty_strided_generic(sizes, strides, neuron_allocator(), keys, dtype);
}

// The structured CPU kernel `Native`, with its one result allocated in device memory and seen through a host alias.
template <class Native>
struct OnDevice final : Native {
  at::Tensor device_out, host_out;
  void set_output_raw_strided(int64_t i, at::IntArrayRef sizes, at::IntArrayRef strides,
                              at::TensorOptions options) override {
    device_out = device_result(sizes, strides, options);
    host_out = host_alias(device_out, host_storage(device_out.storage()));
    Native::set_output_raw_strided(i, sizes, strides, options);
  }
  const at::Tensor& maybe_get_output(int64_t) override { return host_out; }
};

// The same kernel over the device tensors themselves (the direct form, see the top of this file).
template <class Native>
struct Direct final : Native {
  at::Tensor out;
  void set_output_raw_strided(int64_t i, at::IntArrayRef sizes, at::IntArrayRef strides,
                              at::TensorOptions options) override {
    out = device_result(sizes, strides, options);
    Native::set_output_raw_strided(i, sizes, strides, options);
  }
  const at::Tensor& maybe_get_output(int64_t) override { return out; }
  bool uniform_dtype() {
    for (int i = 0; i < this->ntensors(); ++i)
      if (this->dtype(i) != this->dtype(0)) return false;
    return true;
  }
};

// What the arguments allow: the device, whether the plain case holds, the result's element count (an upper bound
// from broadcasting the tensors' sizes; a shape mismatch is the kernel's to report).
struct Operands {
  c10::DeviceIndex device = -1;
  bool plain = true, fp64 = false;
  int64_t dims = 0;
  std::optional<at::ScalarType> dtype;  // the first tensor's; `direct`: all neuron tensors, all of this dtype
  bool direct = true;
  c10::SmallVector<int64_t, 6> sizes;  // innermost first
  void add(const at::Tensor& t) {
    if (!t.defined() || t.layout() != at::kStrided) return void(plain = false);
    if (!dtype) dtype = t.scalar_type();
    direct &= *dtype == t.scalar_type();
    if (t.device().type() != kNeuron) {
      plain &= t.device().is_cpu() && t.dim() == 0;  // a value (a Python number, a CPU scalar tensor)
      direct = false;
      return;
    }
    if (device < 0) device = t.device().index();
    plain &= device == t.device().index();
    fp64 |= is_fp64(t);
    auto s = t.sizes();
    if (s.size() > sizes.size()) sizes.resize(s.size(), 1);
    for (size_t i = 0; i < s.size(); ++i) sizes[i] = std::max(sizes[i], s[s.size() - 1 - i]);
  }
  template <class T>
  void add(const T&) {}
  int64_t elements() const {
    int64_t n = 1;
    for (int64_t s : sizes) n *= s;
    return n;
  }
};

// The host aliases of one call: one CPU storage per device storage (ATen's overlap checks compare storages), and
// one device tensor passed twice (`x * x`) is one CPU tensor twice, as on the CPU.
struct Aliases {
  c10::SmallVector<std::pair<const c10::StorageImpl*, c10::Storage>, 3> storages;
  const c10::TensorImpl* last = nullptr;
  at::Tensor last_alias;
  at::Tensor operator()(const at::Tensor& t) {
    if (t.device().type() != kNeuron) return t;
    if (t.unsafeGetTensorImpl() == last) return last_alias;
    const auto* dev = t.storage().unsafeGetStorageImpl();
    const c10::Storage* host = nullptr;
    for (auto& [d, h] : storages)
      if (d == dev) host = &h;
    if (!host) host = &storages.emplace_back(dev, host_storage(t.storage())).second;
    last = t.unsafeGetTensorImpl();
    return last_alias = host_alias(t, *host);
  }
};
template <class T>
T host_arg(Aliases&, const T& v) {
  return v;
}
at::Tensor host_arg(Aliases& h, const at::Tensor& t) { return h(t); }

template <class T>
c10::IValue boxed(const T& v) {
  return c10::IValue(v);
}
c10::IValue boxed(c10::string_view v) { return c10::IValue(std::string(v)); }
c10::IValue boxed(const std::optional<c10::string_view>& v) { return v ? boxed(*v) : c10::IValue(); }

// One fast op: the aten schema it implements and the structured CPU kernel that computes it.
template <class Native, bool kDirect, const char* Name, const char* Overload, class... Args>
at::Tensor fast_kernel(Args... args) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(Name, Overload);
  static OpEntry& e = op_entry(op);
  warn_deferred();  // int64 events queued kernels found (one relaxed load when there are none)
  Operands o;
  (o.add(args), ...);
  const bool trainium = trainium_rules();
  if (o.plain && o.device >= 0 && !(trainium && o.fp64) && !g_tracing_device.load(std::memory_order_relaxed) &&
      !g_launch_blocking.load(std::memory_order_relaxed) && !g_queue_everything.load(std::memory_order_relaxed) &&
      o.elements() < kInlineElements && !poisoned_storages()) {  // poisoned memory: the fallback checks the reads
    std::optional<c10::DeviceGuard> guard;                       // the result is allocated on the current device
    if (current_device() != o.device) guard.emplace(c10::Device(kNeuron, o.device));
    StreamQueue& q = current_queue(o.device);
    if (q.idle()) {
      count_call(e);  // not a sync point: a pending kernel error waits for one
      count_path(Path::fast);
      if (kDirect && TORCHNEURON_DIRECT_STUBS && o.direct && at::isFloatingType(*o.dtype)) {
        Direct<Native> k;
        if (with_device_oom(o.device, [&] {
              k.meta(args...);
              if (!k.uniform_dtype()) return false;
              k.impl(args..., k.out);
              return true;
            }))
          return std::move(k.out);
      }
      Aliases h;
      auto host = std::make_tuple(host_arg(h, args)...);
      OnDevice<Native> k;
      with_device_oom(o.device, [&] {
        std::apply([&](const auto&... a) { k.meta(a...); }, host);
        std::apply([&](const auto&... a) { k.impl(a..., k.host_out); }, host);
      });
      if (trainium) {  // the result's dtype rules, as the fallback applies them
        if (is_fp64(k.host_out) && !e.exact.load(std::memory_order_relaxed)) {
          round_to_fp32(k.host_out);
          note_fp64(e, Fp64Event::produced);
        }
        note_int64(e, int64_range(k.host_out));
      }
      return std::move(k.device_out);
    }
  }
  torch::jit::Stack stack;
  stack.reserve(sizeof...(Args));
  (stack.push_back(boxed(args)), ...);
  neuron_fallback(op, &stack);
  return stack.back().toTensor();
}

#define FAST(id, name, overload) constexpr char id##_name[] = name, id##_overload[] = overload;
FAST(add, "aten::add", "Tensor")
FAST(sub, "aten::sub", "Tensor")
FAST(mul, "aten::mul", "Tensor")
FAST(div, "aten::div", "Tensor")
FAST(div_mode, "aten::div", "Tensor_mode")
FAST(neg, "aten::neg", "")
FAST(exp, "aten::exp", "")
FAST(log, "aten::log", "")
FAST(sqrt, "aten::sqrt", "")
FAST(rsqrt, "aten::rsqrt", "")
FAST(tanh, "aten::tanh", "")
FAST(sigmoid, "aten::sigmoid", "")
FAST(silu, "aten::silu", "")
FAST(gelu, "aten::gelu", "")
FAST(maximum, "aten::maximum", "")
FAST(minimum, "aten::minimum", "")
FAST(pow_ts, "aten::pow", "Tensor_Scalar")
FAST(pow_tt, "aten::pow", "Tensor_Tensor")
FAST(gelu_backward, "aten::gelu_backward", "")
FAST(tanh_backward, "aten::tanh_backward", "")
FAST(sigmoid_backward, "aten::sigmoid_backward", "")
FAST(silu_backward, "aten::silu_backward", "")
FAST(threshold_backward, "aten::threshold_backward", "")
#undef FAST

using T = const at::Tensor&;
using S = const at::Scalar&;
#define K(id, cls, ...) fast_kernel<at::native::cls, false, id##_name, id##_overload, __VA_ARGS__>
#define D(id, cls, ...) fast_kernel<at::native::cls, true, id##_name, id##_overload, __VA_ARGS__>

}  // namespace

#if TORCHNEURON_DIRECT_STUBS
// PrivateUse1's entry of each stub a direct kernel reaches: the CPU's own (device memory is host memory).
template <auto& Stub, class R, class... A>
void route_to_cpu(R (*)(A...)) {
  Stub.set_privateuse1_dispatch_ptr(+[](A... a) -> R { return Stub(c10::kCPU, a...); });
}
#define ROUTE(stub) route_to_cpu<at::native::stub>(std::remove_reference_t<decltype(at::native::stub)>::FnPtr{})
const bool stubs_routed = [] {
  ROUTE(add_stub), ROUTE(mul_stub), ROUTE(div_true_stub), ROUTE(div_trunc_stub), ROUTE(div_floor_stub);
  ROUTE(neg_stub), ROUTE(exp_stub), ROUTE(log_stub), ROUTE(sqrt_stub), ROUTE(rsqrt_stub), ROUTE(tanh_stub);
  ROUTE(sigmoid_stub), ROUTE(silu_stub), ROUTE(maximum_stub), ROUTE(minimum_stub);
  ROUTE(pow_tensor_scalar_stub), ROUTE(pow_tensor_tensor_stub), ROUTE(tanh_backward_stub);
  ROUTE(sigmoid_backward_stub), ROUTE(silu_backward_stub), ROUTE(threshold_stub);
  return true;
}();
#undef ROUTE
#endif

// The ops (a short table: the hot ones of eager training; every other op takes the boxed fallback).
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("add.Tensor", D(add, structured_ufunc_add_CPU, T, T, S));
  m.impl("sub.Tensor", D(sub, structured_sub_out, T, T, S));
  m.impl("mul.Tensor", D(mul, structured_mul_out, T, T));
  m.impl("div.Tensor", D(div, structured_div_out, T, T));
  m.impl("div.Tensor_mode", D(div_mode, structured_div_out_mode, T, T, std::optional<c10::string_view>));
  m.impl("neg", D(neg, structured_neg_out, T));
  m.impl("exp", D(exp, structured_exp_out, T));
  m.impl("log", D(log, structured_log_out, T));
  m.impl("sqrt", D(sqrt, structured_sqrt_out, T));
  m.impl("rsqrt", D(rsqrt, structured_rsqrt_out, T));
  m.impl("tanh", D(tanh, structured_tanh_out, T));
  m.impl("sigmoid", D(sigmoid, structured_sigmoid_out, T));
  m.impl("silu", D(silu, structured_silu_out, T));
  m.impl("gelu", K(gelu, structured_gelu_out_cpu, T, c10::string_view));
  m.impl("maximum", D(maximum, structured_maximum_out, T, T));
  m.impl("minimum", D(minimum, structured_minimum_out, T, T));
  m.impl("pow.Tensor_Scalar", D(pow_ts, structured_pow_Tensor_Scalar_out, T, S));
  m.impl("pow.Tensor_Tensor", D(pow_tt, structured_pow_Tensor_Tensor_out, T, T));
  m.impl("gelu_backward", K(gelu_backward, structured_gelu_backward_out_cpu, T, T, c10::string_view));
  m.impl("tanh_backward", D(tanh_backward, structured_tanh_backward_out, T, T));
  m.impl("sigmoid_backward", D(sigmoid_backward, structured_sigmoid_backward_out, T, T));
  m.impl("silu_backward", D(silu_backward, structured_silu_backward_out, T, T));
  m.impl("threshold_backward", D(threshold_backward, structured_threshold_backward_out, T, T, S));
}
#undef K
#undef D

}  // namespace torchneuron
