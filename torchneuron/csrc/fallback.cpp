// The boxed fallback: every aten op without an explicit neuron kernel runs the ATen CPU kernel on the same
// memory. Device tensors are handed to the CPU kernel as aliases (same bytes, sizes, strides, offset, conj/neg
// bits; bridge.cpp), so in-place ops, `out=` arguments and views behave exactly as on the CPU; tensors the CPU
// kernel creates are adopted into device memory without a copy; an `out=` argument the CPU kernel resized is given
// the new memory and shape. On the way it applies the device rules (same device, fp64, int64 range; policy.cpp),
// fills in the device generator, and counts each op as native or host fallback (op_tracking.cpp).
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StorageImpl.h>
#include <torch/library.h>

#include <algorithm>

#include "runtime.h"

namespace torchneuron {
namespace {
// Visit every tensor in an IValue (tensor, tensor list, optional tensor list).
template <class F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) f(t);
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toListRef())
      if (x.isTensor()) f(x.toTensor());
  }
}

template <class F>
c10::IValue map_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) return f(v.toTensor());
  if (v.isTensorList()) {
    auto in = v.toTensorList();
    c10::List<at::Tensor> out;
    out.reserve(in.size());
    for (const at::Tensor& t : in) out.push_back(f(t));
    return out;
  }
  if (v.isList()) {
    auto in = v.toList();
    if (!in.elementType()->cast<c10::OptionalType>() ||
        in.elementType()->cast<c10::OptionalType>()->getElementType()->kind() != c10::TypeKind::TensorType)
      return v;
    c10::List<std::optional<at::Tensor>> out;
    out.reserve(in.size());
    for (const c10::IValue& x : in.vec()) out.push_back(x.isTensor() ? std::optional<at::Tensor>(f(x.toTensor())) : std::nullopt);
    return out;
  }
  return v;
}

bool is_neuron(const at::Tensor& t) { return t.defined() && t.device().type() == kNeuron; }

// A few entries per op call: a linear scan over inline storage beats hashing and allocates nothing.
template <class K, class V>
struct SmallMap {
  c10::SmallVector<std::pair<K, V>, 6> items;
  V* find(K k) {
    for (auto& [key, v] : items)
      if (key == k) return &v;
    return nullptr;
  }
  V& add(K k, V v) { return items.emplace_back(k, std::move(v)).second; }
};

// Everything a call learns while preparing the CPU arguments, used to map the results back.
struct Call {
  c10::DeviceIndex device = -1;
  bool fp64 = false;   // a float64 device tensor takes part: host values entering the op obey the fp64 rule
  bool entered = false;  // such a host value lost precision on the way in
  HostAliases host;    // one CPU storage per device storage, so ATen's overlap checks see the real memory
  SmallMap<const c10::StorageImpl*, c10::Storage> alias_to_device;  // CPU alias storage -> device storage
  SmallMap<const c10::TensorImpl*, at::Tensor> alias_to_tensor;    // CPU alias tensor -> device tensor
};

void check_same_device(Call& c, const at::Tensor& t, const OpEntry& e) {
  if (!t.defined()) return;
  if (is_neuron(t)) {
    c.fp64 |= is_fp64(t);
    if (c.device < 0) c.device = t.device().index();
    TORCH_CHECK(c.device == t.device().index(),
                "Expected all tensors to be on the same device, but found at least two devices, neuron:",
                static_cast<int>(c.device), " and ", t.device(), "! (in ", e.name, ")");
  }
}

void check_host_operand(const Call& c, const at::Tensor& t, const OpEntry& e) {
  if (t.defined() && !is_neuron(t) && c.device >= 0 && t.dim() > 0 && !e.host_tensors.load(std::memory_order_relaxed)) {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, neuron:",
                static_cast<int>(c.device), " and ", t.device(), "! (in ", e.name,
                "; move the tensor with .to('neuron') first)");
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!t.defined() || t.layout() == at::kStrided, "neuron: ", e.name, " got a ",
                              t.layout(), " tensor; the neuron device supports only strided (dense) tensors");
}

// Trainium rule for host data entering a float64 op (a CPU value tensor, a Python number): like a host->device
// copy, it carries float32 precision.
at::Tensor round_host_value(Call& c, const at::Tensor& t) {
  at::Tensor r = t.to(t.scalar_type() == at::kDouble ? at::kFloat : at::kComplexFloat).to(t.scalar_type());
  if (r.equal(t)) return t;
  r.unsafeGetTensorImpl()->set_wrapped_number(t.unsafeGetTensorImpl()->is_wrapped_number());
  c.entered = true;
  return r;
}

// `round_values`: a host fp64 tensor here is a value entering the op (not one it writes, as an `out=` scalar).
at::Tensor to_host(Call& c, const at::Tensor& t, bool round_values) {
  if (!is_neuron(t)) return round_values && is_fp64(t) && t.numel() > 0 ? round_host_value(c, t) : t;
  // The same device tensor passed twice (an input that is also `out=`) is the same CPU tensor twice, as on the
  // CPU: ATen's overlap checks treat one TensorImpl as full overlap even when it holds no elements.
  for (auto& [alias, dev] : c.alias_to_tensor.items)
    if (dev.unsafeGetTensorImpl() == t.unsafeGetTensorImpl())
      return at::Tensor(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(const_cast<c10::TensorImpl*>(alias)));
  at::Tensor a = c.host(t);
  if (!c.alias_to_device.find(a.storage().unsafeGetStorageImpl()))
    c.alias_to_device.add(a.storage().unsafeGetStorageImpl(), t.storage());
  c.alias_to_tensor.add(a.unsafeGetTensorImpl(), t);
  return a;
}

void round_host_scalar(Call& c, c10::IValue& v) {
  if (v.isDouble()) {
    double x = v.toDouble(), r = static_cast<float>(x);
    if (r != x && x == x) v = r, c.entered = true;
  } else if (v.isComplexDouble()) {
    c10::complex<double> x = v.toComplexDouble();
    c10::complex<double> r(static_cast<float>(x.real()), static_cast<float>(x.imag()));
    if (r != x && x == x) v = r, c.entered = true;
  }
}

}  // namespace

void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  c10::IValue* args = stack->data() + (stack->size() - nargs);
  const bool trainium = trainium_rules();

  OpEntry& e = op_entry(op);
  Call c;
  for (size_t i = 0; i < nargs; ++i) for_each_tensor(args[i], [&](const at::Tensor& t) { check_same_device(c, t, e); });
  count_call(e);
  if (c.device < 0) c.device = current_device();
  c10::DeviceGuard guard(c10::Device(kNeuron, c.device));
  KernelEvent event(e.name.c_str(), c.device, &schema, c10::ArrayRef<c10::IValue>(args, nargs));  // torch.profiler

  for (size_t i = 0; i < nargs; ++i) {
    for_each_tensor(args[i], [&](const at::Tensor& t) { check_host_operand(c, t, e); });
    bool round_values = trainium && c.fp64 && std::find(e.writes.begin(), e.writes.end(), i) == e.writes.end();
    args[i] = map_tensors(args[i], [&](const at::Tensor& t) { return to_host(c, t, round_values); });
  }
  if (trainium && c.fp64)
    for (size_t i : e.scalars) round_host_scalar(c, args[i]);
  std::vector<at::Generator> drawn;  // neuron generators this op draws from: advanced by its size afterwards
  for (size_t i : e.generators) {
    if (!args[i].isNone() && !args[i].isGenerator()) continue;
    drawn.push_back(args[i].isNone() ? default_generator(c.device) : args[i].toGenerator());
    args[i] = host_generator_of(drawn.back());  // refuses a generator of another device, as CUDA does
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // (device tensor, its CPU alias)
  for (size_t i : e.writes)
    for_each_tensor(args[i], [&](const at::Tensor& a) {
      if (at::Tensor* dev = c.alias_to_tensor.find(a.unsafeGetTensorImpl())) written.emplace_back(*dev, a);
    });

  with_device_oom(c.device, [&] { op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack); });
  if (!drawn.empty()) {
    uint64_t n = 0;
    for (size_t i = stack->size() - schema.returns().size(); i < stack->size(); ++i)
      for_each_tensor((*stack)[i], [&](const at::Tensor& t) { n = std::max<uint64_t>(n, t.numel()); });
    for (auto& g : drawn) advance_generator(g, n);
  }

  bool rounded = c.entered;
  Int64Range int64;
  auto apply_rules = [&](const at::Tensor& host) {
    if (!trainium) return;
    if (is_fp64(host) && !e.exact.load(std::memory_order_relaxed)) round_to_fp32(host), rounded = true;
    if (!int64.outside) int64 = int64_range(host);
  };
  for (auto& [dev, alias] : written) {
    apply_rules(alias);  // before sync_written: it may move the alias's memory into the device tensor
    sync_written(dev, alias);
  }

  // Map the results back onto the device: written arguments, views of inputs, or fresh (adopted) memory.
  const size_t nret = schema.returns().size();
  SmallMap<const c10::StorageImpl*, int> fresh_uses;  // how many results share each storage the kernel made
  for (size_t i = stack->size() - nret; i < stack->size(); ++i)
    for_each_tensor((*stack)[i], [&](const at::Tensor& t) {
      if (!t.defined() || t.layout() != at::kStrided) return;
      auto* simpl = t.storage().unsafeGetStorageImpl();
      if (c.alias_to_device.find(simpl)) return;
      if (int* n = fresh_uses.find(simpl)) ++*n;
      else fresh_uses.add(simpl, 1);
    });
  SmallMap<const c10::StorageImpl*, c10::Storage> adopted;
  auto to_device = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || is_neuron(t)) return t;
    TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided, "neuron: ", e.name, " would return a ", t.layout(),
                                " tensor; the neuron device supports only strided (dense) tensors");
    if (at::Tensor* dev = c.alias_to_tensor.find(t.unsafeGetTensorImpl())) return *dev;
    auto* simpl = t.storage().unsafeGetStorageImpl();
    if (c10::Storage* s = c.alias_to_device.find(simpl)) return device_tensor_like(*s, t);  // a view of an input
    apply_rules(t);
    if (c10::Storage* s = adopted.find(simpl)) return device_tensor_like(*s, t);  // shares a result's storage
    int uses = *fresh_uses.find(simpl);
    if (static_cast<int>(t.storage().use_count()) > uses) return adopt_host_tensor(t.clone(), c.device);  // held elsewhere
    at::Tensor dev = adopt_host_tensor(t, c.device);
    if (uses > 1) adopted.add(simpl, dev.storage());
    return dev;
  };
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) (*stack)[i] = map_tensors((*stack)[i], to_device);

  event.end(c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - nret, nret));
  if (rounded) note_fp64(e, c.entered ? Fp64Event::received : Fp64Event::produced);
  note_int64(e, int64);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>()); }

}  // namespace torchneuron
