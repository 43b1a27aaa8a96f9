// The boxed fallback: every aten op without an explicit neuron kernel runs the ATen CPU kernel on the same
// memory. Device tensors are handed to the CPU kernel as aliases (same bytes, sizes, strides, offset, conj/neg
// bits), so in-place ops, `out=` arguments and views behave exactly as on the CPU; tensors the CPU kernel
// creates are adopted into device memory without a copy; an `out=` argument the CPU kernel resized is given
// the new memory and shape. On the way it applies the device rules (same device, fp64, int64 range), fills
// in the device generator, and counts each op as native or host fallback (runtime/native_ops.py).
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StorageImpl.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "runtime.h"

namespace torchneuron {
namespace {

std::atomic<int> g_dtype_policy{static_cast<int>(DtypePolicy::trainium)};
std::atomic<int> g_fallback_policy{static_cast<int>(FallbackPolicy::warn)};

struct OpEntry {
  std::string name;  // "aten::add_" (overload dropped)
  bool native = false;
  bool allows_host_tensors = false;  // ops documented to take CPU index tensors alongside device ones
  bool exact = false;                // pure data movement: keeps every bit under the trainium dtype policy
  std::vector<size_t> generators, writes, scalars;  // argument positions (scalars: `Scalar` values)
  int64_t executed = 0, fallback = 0, dtype_events = 0;
  bool warned_fallback = false, warned_fp64 = false, warned_int64 = false;
};

std::mutex g_mu;
std::unordered_map<const c10::FunctionSchema*, OpEntry> g_ops;
std::unordered_set<std::string> g_native, g_exact;  // base names, e.g. "add", "mm"
std::unordered_map<std::string, int64_t> g_explicit;  // ops run by explicit kernels
OpEntry g_copy_in = [] {
  OpEntry e;
  e.name = "aten::copy_ (host to neuron)";
  return e;
}();
std::unordered_map<std::string, OpEntry> g_outside;  // device results computed outside the fallback (collectives)
thread_local bool t_internal_math = false;           // see set_internal_math

std::string base_name(const std::string& name) {
  auto pos = name.rfind("::");
  std::string s = pos == std::string::npos ? name : name.substr(pos + 2);
  if (s.size() > 1 && s.back() == '_' && s[s.size() - 2] != '_') s.pop_back();  // in-place variant
  return s;
}

OpEntry named_entry(const std::string& name) {
  OpEntry e;
  e.name = name;
  return e;
}

bool is_type(const c10::TypePtr& t, c10::TypeKind k) {
  if (t->kind() == k) return true;
  auto opt = t->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == k;
}

OpEntry& entry_for(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  auto it = g_ops.find(&schema);
  if (it != g_ops.end()) return it->second;
  OpEntry e;
  e.name = schema.name();
  auto b = base_name(e.name);
  e.native = g_native.count(b) > 0;
  e.exact = g_exact.count(b) > 0;
  e.allows_host_tensors = b == "index" || b == "index_put" || b == "_index_put_impl" || b == "_local_scalar_dense";
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (is_type(args[i].type(), c10::TypeKind::GeneratorType)) e.generators.push_back(i);
    if (args[i].alias_info() && args[i].alias_info()->isWrite()) e.writes.push_back(i);
    if (is_type(args[i].type(), c10::TypeKind::NumberType)) e.scalars.push_back(i);
  }
  return g_ops.emplace(&schema, std::move(e)).first->second;
}

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

}  // namespace

// A neuron tensor with the metadata (and conj/neg bits) of `host` over `storage`.
at::Tensor device_tensor_like(const c10::Storage& storage, const at::Tensor& host) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                    host.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(host.sizes(), host.strides(), host.storage_offset());
  t._set_conj(host.is_conj());
  t._set_neg(host.is_neg());
  return t;
}

namespace {

bool is_fp64(const at::Tensor& t) {
  return t.defined() && (t.scalar_type() == at::kDouble || t.scalar_type() == at::kComplexDouble);
}

// Trainium rule for float64: values carry float32 precision (see docs/policies.md).
void round_to_fp32(const at::Tensor& host) {
  if (is_fp64(host) && host.numel() > 0)
    host.copy_(host.to(host.scalar_type() == at::kDouble ? at::kFloat : at::kComplexFloat));
}

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
  if (t.defined() && !is_neuron(t) && c.device >= 0 && t.dim() > 0 && !e.allows_host_tensors) {
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

// After the CPU kernel: make a written device argument match what the kernel did to its alias.
void sync_written(const at::Tensor& dev, const at::Tensor& alias) {
  auto* dimpl = dev.unsafeGetTensorImpl();
  auto* astore = alias.storage().unsafeGetStorageImpl();
  auto* dstore = dev.storage().unsafeGetStorageImpl();
  if (astore->data() != dstore->data() || astore->nbytes() != dstore->nbytes()) {
    if (astore->data() != dstore->data()) {  // the kernel reallocated: adopt its memory, no copy
      c10::DataPtr host = astore->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
      dstore->set_data_ptr_noswap(adopt_host_memory(std::move(host), astore->nbytes(), dev.device().index()));
      // the alias storage keeps viewing it, so a second written argument over the same storage is in sync
      astore->set_data_ptr_noswap(c10::DataPtr(dstore->mutable_data(), c10::Device(c10::kCPU)));
    }
    dstore->set_nbytes(astore->nbytes());
  }
  if (dev.sizes() != alias.sizes() || dev.strides() != alias.strides() || dev.storage_offset() != alias.storage_offset())
    dimpl->set_sizes_and_strides(alias.sizes(), alias.strides(), alias.storage_offset());
}

struct Int64Range {
  int64_t lo = 0, hi = 0;
  bool outside = false;  // some value does not fit int32
};

Int64Range int64_range(const at::Tensor& host) {
  if (host.scalar_type() != at::kLong || host.numel() == 0) return {};
  auto [lo, hi] = at::aminmax(host);
  Int64Range r{lo.item<int64_t>(), hi.item<int64_t>()};
  r.outside = r.lo < std::numeric_limits<int32_t>::min() || r.hi > std::numeric_limits<int32_t>::max();
  return r;
}

// Count (in get_dtype_events) and warn once per op. Call with g_mu held.
void note_int64(OpEntry& e, const Int64Range& r) {
  if (!r.outside) return;
  e.dtype_events++;
  if (e.warned_int64) return;
  e.warned_int64 = true;
  TORCH_WARN("neuron: ", e.name, " produced int64 values outside the int32 range [", r.lo, ", ", r.hi,
             "]; Trainium computes int64 as 32-bit, so real hardware would wrap them "
             "(values are kept exact here; TORCHNEURON_DTYPE_POLICY=host silences this)");
}

void note_fp64(OpEntry& e, bool entered) {  // g_mu held
  e.dtype_events++;
  if (e.warned_fp64) return;
  e.warned_fp64 = true;
  if (entered) {
    TORCH_WARN("neuron: ", e.name, " received float64 host values (a Python number or CPU tensor); Trainium has no "
               "fp64, so they carry float32 precision (rounded to the nearest float32). TORCHNEURON_DTYPE_POLICY=host "
               "keeps full precision.");
  } else {
    TORCH_WARN("neuron: ", e.name, " produced float64 values; Trainium has no fp64, so they carry float32 "
               "precision (rounded to the nearest float32). TORCHNEURON_DTYPE_POLICY=host keeps full precision.");
  }
}

}  // namespace

void set_policies(DtypePolicy dtype, FallbackPolicy fallback) {
  g_dtype_policy = static_cast<int>(dtype);
  g_fallback_policy = static_cast<int>(fallback);
}

void set_op_tables(const std::vector<std::string>& native, const std::vector<std::string>& exact) {
  std::lock_guard<std::mutex> g(g_mu);
  g_native = {native.begin(), native.end()};
  g_exact = {exact.begin(), exact.end()};
  for (auto& [schema, e] : g_ops) {
    e.native = g_native.count(base_name(e.name)) > 0;
    e.exact = g_exact.count(base_name(e.name)) > 0;
  }
}

void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  c10::IValue* args = stack->data() + (stack->size() - nargs);
  const bool trainium =
      g_dtype_policy.load(std::memory_order_relaxed) == static_cast<int>(DtypePolicy::trainium) && !t_internal_math;

  Call c;
  OpEntry* e;
  {
    std::lock_guard<std::mutex> g(g_mu);
    e = &entry_for(op);
    for (size_t i = 0; i < nargs; ++i) for_each_tensor(args[i], [&](const at::Tensor& t) {
      check_same_device(c, t, *e);
    });
    if (e->native) {
      e->executed++;
    } else {
      e->fallback++;
      auto policy = static_cast<FallbackPolicy>(g_fallback_policy.load());
      TORCH_CHECK_NOT_IMPLEMENTED(policy != FallbackPolicy::error, "neuron: ", e->name,
                                  " is not a native neuron op and TORCHNEURON_FALLBACK=error forbids running it as a "
                                  "host fallback (set TORCHNEURON_FALLBACK=warn to allow it)");
      if (policy == FallbackPolicy::warn && !e->warned_fallback) {
        e->warned_fallback = true;
        TORCH_WARN("neuron: ", e->name, " is not a native neuron op; it runs as a host (CPU) fallback. "
                   "torchneuron.get_fallback_ops() lists them; TORCHNEURON_FALLBACK=silent|error changes this.");
      }
    }
  }
  if (c.device < 0) c.device = current_device();
  c10::DeviceGuard guard(c10::Device(kNeuron, c.device));
  KernelEvent event(e->name.c_str(), c.device, &schema, c10::ArrayRef<c10::IValue>(args, nargs));  // torch.profiler

  for (size_t i = 0; i < nargs; ++i) {
    for_each_tensor(args[i], [&](const at::Tensor& t) { check_host_operand(c, t, *e); });
    bool round_values = trainium && c.fp64 && std::find(e->writes.begin(), e->writes.end(), i) == e->writes.end();
    args[i] = map_tensors(args[i], [&](const at::Tensor& t) { return to_host(c, t, round_values); });
  }
  if (trainium && c.fp64)
    for (size_t i : e->scalars) round_host_scalar(c, args[i]);
  std::vector<at::Generator> drawn;  // neuron generators this op draws from: advanced by its size afterwards
  for (size_t i : e->generators) {
    if (!args[i].isNone() && !args[i].isGenerator()) continue;
    drawn.push_back(args[i].isNone() ? default_generator(c.device) : args[i].toGenerator());
    args[i] = host_generator_of(drawn.back());  // refuses a generator of another device, as CUDA does
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // (device tensor, its CPU alias)
  for (size_t i : e->writes)
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
    if (is_fp64(host) && !e->exact) round_to_fp32(host), rounded = true;
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
    TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided, "neuron: ", e->name, " would return a ", t.layout(),
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
  if (rounded || int64.outside) {
    std::lock_guard<std::mutex> g(g_mu);
    if (rounded) note_fp64(*e, c.entered);
    note_int64(*e, int64);
  }
}

bool set_internal_math(bool on) {
  bool was = t_internal_math;
  t_internal_math = on;
  return was;
}

void note_device_result(const std::string& name, const at::Tensor& t) {
  if (g_dtype_policy.load(std::memory_order_relaxed) != static_cast<int>(DtypePolicy::trainium) || t_internal_math ||
      !is_neuron(t) || !is_fp64(t) || t.numel() == 0)
    return;
  round_to_fp32(host_alias(t));
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_outside.try_emplace(name, named_entry(name)).first;
  note_fp64(it->second, false);
}

void note_executed(const char* name) {
  std::lock_guard<std::mutex> g(g_mu);
  g_explicit[name]++;
}

void note_host_to_device(const at::Tensor& host) {
  if (g_dtype_policy.load(std::memory_order_relaxed) != static_cast<int>(DtypePolicy::trainium) || t_internal_math)
    return;
  if (!is_fp64(host) && host.scalar_type() != at::kLong) return;
  if (is_fp64(host)) round_to_fp32(host);
  Int64Range int64 = int64_range(host);
  std::lock_guard<std::mutex> g(g_mu);
  OpEntry& copy_in = g_copy_in;
  if (is_fp64(host)) {
    copy_in.dtype_events++;
    if (!copy_in.warned_fp64) {
      copy_in.warned_fp64 = true;
      TORCH_WARN("neuron: float64 data copied to the device carries float32 precision (Trainium has no fp64); "
                 "TORCHNEURON_DTYPE_POLICY=host keeps full precision.");
    }
  }
  note_int64(copy_in, int64);
}

// Composite kernels that refuse every device but CPU/CUDA/XPU (a device-type TORCH_CHECK in ATen; the list comes
// from searching ATen's sources and messages, see docs/device.md). Routed through the fallback, the CPU's entry runs
// the same composite on the host aliases, where the check passes.
const std::unordered_set<std::string> kDeviceCheckedComposites = {"mode.values"};

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

std::vector<std::pair<std::string, int64_t>> executed_ops() {
  std::lock_guard<std::mutex> g(g_mu);
  std::unordered_map<std::string, int64_t> agg;
  for (auto& [s, e] : g_ops)
    if (e.executed) agg[e.name] += e.executed;
  for (auto& [n, k] : g_explicit) agg[n] += k;
  return {agg.begin(), agg.end()};
}

std::vector<std::pair<std::string, int64_t>> fallback_ops() {
  std::lock_guard<std::mutex> g(g_mu);
  std::unordered_map<std::string, int64_t> agg;
  for (auto& [s, e] : g_ops)
    if (e.fallback) agg[e.name] += e.fallback;
  return {agg.begin(), agg.end()};
}

std::vector<std::pair<std::string, int64_t>> dtype_events() {
  std::lock_guard<std::mutex> g(g_mu);
  std::unordered_map<std::string, int64_t> agg;
  for (auto& [s, e] : g_ops)
    if (e.dtype_events) agg[e.name] += e.dtype_events;
  if (g_copy_in.dtype_events) agg[g_copy_in.name] += g_copy_in.dtype_events;
  for (auto& [n, e] : g_outside)
    if (e.dtype_events) agg[n] += e.dtype_events;
  return {agg.begin(), agg.end()};
}

void clear_op_tracking() {
  std::lock_guard<std::mutex> g(g_mu);
  g_explicit.clear();
  g_copy_in.dtype_events = 0;
  g_copy_in.warned_fp64 = g_copy_in.warned_int64 = false;
  g_outside.clear();
  for (auto& [s, e] : g_ops) {
    e.executed = e.fallback = e.dtype_events = 0;
    e.warned_fallback = e.warned_fp64 = e.warned_int64 = false;
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>()); }

}  // namespace torchneuron
