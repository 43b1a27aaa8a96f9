// The boxed fallback: every aten op without an explicit neuron kernel runs the ATen CPU kernel on the same
// memory. Device tensors are handed to the CPU kernel as aliases (same bytes, sizes, strides, offset, conj/neg
// bits; bridge.cpp), so in-place ops, `out=` arguments and views behave exactly as on the CPU; tensors the CPU
// kernel creates are adopted into device memory without a copy; an `out=` argument the CPU kernel resized is given
// the new memory and shape. On the way it applies the device rules (same device, fp64, int64 range; policy.cpp),
// fills in the device generator, and counts each op as native or host fallback (op_tracking.cpp).
//
// Execution is stream-ordered (queue.cpp): an op is queued on the current stream and its results are returned
// before it runs, with the metadata (sizes, strides, dtype, which results alias which arguments) it had the first
// time it ran with the same argument signature. That first run happens on the host thread after the stream's
// earlier work, and records the layout; ops whose results depend on data (tags dynamic_output_shape and
// data_dependent_output, non-tensor results), checks without results, ops taking CPU index tensors, and ops under
// the trainium dtype rules (float64 involved, int64 results, whose values the rules must inspect) always run that
// way. Views run at once (metadata only). A cached layout costs a hash of the arguments' metadata; PyTorch's meta
// kernels would do the same job, but most of them are Python (~250 us per call here), and some disagree with the
// CPU kernel (mvlgamma, batch norm's saved statistics), while the recorded layout is the CPU kernel's own.
//
// The units: this file (checks, the path of each call, host execution), layout.cpp (result layouts) and
// queued_launch.cpp (queued kernels), sharing fallback.h.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>

#include "fallback.h"

namespace torchneuron {
namespace fallback {
namespace {

// The work a kernel's thread count is chosen by (kernel_threads). A recurrent kernel splits one time step at a time
// (its input's first dim): its work is one step's. A float16/bfloat16 reduction (ATen's reduction tag) rounds each
// thread's partial result to its dtype, so its value follows the thread split: it counts as full work and runs with
// the launching thread's count, the split (and the answer) of the CPU at that count.
int64_t thread_work(const c10::OperatorHandle& op, const OpEntry& e, int64_t work, const c10::IValue* args,
                    size_t nargs) {
  if (e.recurrent.load(std::memory_order_relaxed) && nargs > 0 && args[0].isTensor() && args[0].toTensor().dim() > 0)
    work /= std::max<int64_t>(1, args[0].toTensor().size(0));
  if (work >= kFullThreadsWork || !op.hasTag(at::Tag::reduction)) return work;
  bool half = false;
  for (size_t i = 0; i < nargs; ++i)
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      half |= t.defined() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
    });
  return half ? kFullThreadsWork : work;
}

// The device storages a call reads and writes: every device argument is read, except an out= argument and the
// argument of an op that overwrites it (fill_, zero_), written only; written arguments are the schema's mutable ones.
Access access_of(const OpEntry& e, const c10::FunctionSchema& schema, const c10::IValue* args, size_t nargs) {
  Access a;
  for (size_t i = 0; i < nargs; ++i) {
    const bool write = std::find(e.writes.begin(), e.writes.end(), i) != e.writes.end();
    const bool read = !(write && (schema.arguments()[i].kwarg_only() || e.overwrites.load(std::memory_order_relaxed)));
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (is_neuron(t)) a.push_back(touch(t, read, write));
    });
  }
  return a;
}

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
  TORCH_CHECK_NOT_IMPLEMENTED(!t.defined() || t.layout() == at::kStrided, "neuron: ", e.name, " got a ", t.layout(),
                              " tensor; the neuron device supports only strided (dense) tensors");
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
  if (const c10::TensorImpl** alias = c.tensor_to_alias.find(t.unsafeGetTensorImpl()))
    return at::Tensor(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(const_cast<c10::TensorImpl*>(*alias)));
  at::Tensor a = c.host(t);
  if (!c.alias_to_device.find(a.storage().unsafeGetStorageImpl()))
    c.alias_to_device.add(a.storage().unsafeGetStorageImpl(), t.storage());
  c.alias_to_tensor.add(a.unsafeGetTensorImpl(), t);
  c.tensor_to_alias.add(t.unsafeGetTensorImpl(), a.unsafeGetTensorImpl());
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

// The op's execution class, from its schema and tags (decided once per op).
OpEntry::Exec classify_exec(const c10::OperatorHandle& op, const OpEntry& e) {
  const auto& schema = op.schema();
  bool views = !schema.returns().empty();
  for (const auto& r : schema.returns()) {
    auto kind = r.type()->kind();
    bool tensors =
        kind == c10::TypeKind::TensorType ||
        (kind == c10::TypeKind::ListType && r.type()->containedType(0)->kind() == c10::TypeKind::TensorType) ||
        (kind == c10::TypeKind::OptionalType && r.type()->containedType(0)->kind() == c10::TypeKind::TensorType);
    if (!tensors) return OpEntry::Exec::sync;  // a number or a bool: read from the results
    views &= r.alias_info() && !r.alias_info()->isWrite();
  }
  if (op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output) ||
      e.host_tensors.load(std::memory_order_relaxed))
    return OpEntry::Exec::host;
  if (schema.returns().empty() && e.writes.empty()) return OpEntry::Exec::host;  // a check: its error is its result
  if (views && e.writes.empty()) return OpEntry::Exec::now;
  return OpEntry::Exec::queued;
}

// Run the op now, on this thread, as one CPU kernel call over host aliases (the stream's earlier work is complete
// or is none of its business).
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack, OpEntry& e, Call& c, bool trainium) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  c10::IValue* args = stack->data() + (stack->size() - nargs);
  KernelEvent event(e.name.c_str(), c.device, &schema, c10::ArrayRef<c10::IValue>(args, nargs));  // torch.profiler

  for (size_t i = 0; i < nargs; ++i) {
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
  int64_t work = 0;  // its largest argument (its results are not known yet)
  for (size_t i = 0; i < nargs; ++i)
    for_each_tensor(args[i], [&](const at::Tensor& t) { work = std::max(work, t.numel()); });
  {
    KernelThreadsGuard threads(thread_work(op, e, work, args, nargs));
    with_device_oom(c.device, [&] { op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack); });
  }
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
      if (int* n = fresh_uses.find(simpl))
        ++*n;
      else
        fresh_uses.add(simpl, 1);
    });
  SmallMap<const c10::StorageImpl*, c10::Storage> adopted;
  auto to_device = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || is_neuron(t)) return t;
    std::string kind = unheld_kind(t);
    TORCH_CHECK_NOT_IMPLEMENTED(kind.empty(), "neuron: ", e.name, " would return a ", kind,
                                " tensor; the neuron device holds only strided (dense) and sparse COO tensors");
    if (at::Tensor* dev = c.alias_to_tensor.find(t.unsafeGetTensorImpl())) return *dev;
    auto* simpl = t.storage().unsafeGetStorageImpl();
    if (c10::Storage* s = c.alias_to_device.find(simpl)) return device_tensor_like(*s, t);  // a view of an input
    apply_rules(t);
    if (c10::Storage* s = adopted.find(simpl)) return device_tensor_like(*s, t);  // shares a result's storage
    int uses = *fresh_uses.find(simpl);
    if (static_cast<int>(t.storage().use_count()) > uses)
      return adopt_host_tensor(t.clone(), c.device);  // held elsewhere
    at::Tensor dev = adopt_host_tensor(t, c.device);
    if (uses > 1) adopted.add(simpl, dev.storage());
    return dev;
  };
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) (*stack)[i] = map_tensors((*stack)[i], to_device);

  event.end(c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - nret, nret));
  if (rounded) note_fp64(e, c.entered ? Fp64Event::received : Fp64Event::produced);
  note_int64(e, int64);
}

}  // namespace

void run(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  warn_deferred();  // int64 events queued kernels found (one relaxed load when there are none)
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  c10::IValue* args = stack->data() + (stack->size() - nargs);
  const bool trainium = trainium_rules();

  OpEntry& e = op_entry(op);
  Call c;
  for (size_t i = 0; i < nargs; ++i) for_each_tensor(args[i], [&](const at::Tensor& t) { check_same_device(c, t, e); });
  for (size_t i = 0; i < nargs; ++i)
    for_each_tensor(args[i], [&](const at::Tensor& t) { check_host_operand(c, t, e); });
  count_call(e);
  const bool factory = c.device < 0;
  if (factory) c.device = current_device();
  c10::DeviceGuard guard(c10::Device(kNeuron, c.device));

  auto exec = static_cast<OpEntry::Exec>(e.exec.load(std::memory_order_relaxed));
  if (exec == OpEntry::Exec::unknown) e.exec.store(static_cast<uint8_t>(exec = classify_exec(op, e)));
  if (exec == OpEntry::Exec::now) return count_path(Path::now), run_on_host(op, stack, e, c, trainium);  // views
  Access access = access_of(e, schema, args, nargs);
  // On the host thread, after the stream's work: its own checks come first (the CPU's error for bad arguments); if
  // it read memory a failure left uncomputed, what it wrote is poisoned too and that failure is raised; else what it
  // wrote whole is computed.
  auto on_host_now = [&] {
    FailurePtr f = poisoned(access);
    run_on_host(op, stack, e, c, trainium);
    if (f) poison_writes(access, f), raise_poisoned(*f, e.name.c_str());
    clear_poison(access);
  };
  StreamQueue& q = current_queue(c.device);
  bool blocking = g_launch_blocking.load(std::memory_order_relaxed) || g_tracing_device.load(std::memory_order_relaxed);
  if (exec == OpEntry::Exec::host || exec == OpEntry::Exec::sync || blocking || (trainium && c.fp64)) {
    // A runtime-internal wait, not a sync point: a failure pending on the stream waits for one (this op raises it
    // only if it reads memory the failure left uncomputed). `t[idx]` is no sync point on CUDA either; `.item()`,
    // `torch.equal` (a number or a bool to Python) are.
    if (!q.idle()) e.waited.fetch_add(1, std::memory_order_relaxed), q.wait_quiet(q.enqueued());
    if (exec == OpEntry::Exec::sync) q.raise_error();
    warn_deferred();  // what the kernels it waited for found
    count_path(Path::host);
    return on_host_now();
  }
  KeyBuffer buffer;
  std::vector<int64_t>& key = buffer.key;
  FlatArgs flat;
  bool out_form = false;  // an out= overload: writes a keyword-only argument
  for (size_t i : e.writes) out_form |= schema.arguments()[i].kwarg_only();
  bool keyed = signature(args, nargs, factory || out_form, key, flat);
  auto L = keyed ? find_layout(e, key) : nullptr;
  bool writes_int64 = false;  // the trainium rules inspect what an op writes into an int64 argument
  if (trainium)
    for (size_t i : e.writes)
      for_each_tensor(args[i], [&](const at::Tensor& t) { writes_int64 |= t.scalar_type() == at::kLong; });
  int64_t work = L ? L->max_numel : 0;  // the largest tensor, argument or result (a reduction's input is its work)
  bool int64_args = false;
  for (const at::Tensor& t : flat) {
    work = std::max<int64_t>(work, t.defined() ? t.numel() : 0);
    int64_args |= t.defined() && t.scalar_type() == at::kLong;
  }
  work = thread_work(op, e, work, args, nargs);
  // int64 values the trainium rules look at (on the worker, once the kernel ran): not an op's indices into arguments
  // that cannot hold 2^31 values, which fit int32 by construction
  const bool inspect_int64 = trainium && ((L && L->int64) || writes_int64) &&
                             !(e.indices.load(std::memory_order_relaxed) && !int64_args && work < (int64_t{1} << 31));
  if (L && !run_inline(q, work) && sizable_now(*L, flat)) {
    // a known signature passed the op's own checks; what it reads was never computed: raised at the launch (with
    // work pending, a queued write may still make it computed: the worker decides when the kernel's turn comes)
    if (q.idle()) raise_if_poisoned(access, e.name.c_str());
    return launch_queued(op, stack, e, c, std::move(L), flat, q, work, inspect_int64, std::move(access));
  }
  // not a sync point: the stream's pending error waits for one (an unrelated op goes on)
  if (!q.idle()) e.waited.fetch_add(1, std::memory_order_relaxed), q.wait_quiet(q.enqueued());
  warn_deferred();
  count_path(L || !keyed ? Path::host : Path::first_call);
  if (L || !keyed) return on_host_now();
  std::vector<Shape> before = shapes_of(flat);  // to see whether the kernel changed a device argument's shape
  on_host_now();
  if (auto recorded = record_layout(schema, *stack, flat, before))
    remember_layout(e, std::move(key), std::move(recorded));
}

}  // namespace fallback

void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { fallback::run(op, stack); }

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>()); }

}  // namespace torchneuron
