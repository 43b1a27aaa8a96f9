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
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StorageImpl.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <shared_mutex>
#include <unordered_map>

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

// The work a kernel's thread count is chosen by (kernel_threads). A float16/bfloat16 reduction (ATen's reduction
// tag) rounds each thread's partial result to its dtype, so its value follows the thread split: it counts as full
// work and runs with the launching thread's count, the split (and the answer) of the CPU at that count.
int64_t thread_work(const c10::OperatorHandle& op, int64_t work, const c10::IValue* args, size_t nargs) {
  if (work >= kFullThreadsWork || !op.hasTag(at::Tag::reduction)) return work;
  bool half = false;
  for (size_t i = 0; i < nargs; ++i)
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      half |= t.defined() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
    });
  return half ? kFullThreadsWork : work;
}

// The device storages a call reads and writes: every device argument is read, except an out= argument (written
// only); written arguments are the schema's mutable ones.
Access access_of(const OpEntry& e, const c10::FunctionSchema& schema, const c10::IValue* args, size_t nargs) {
  Access a;
  for (size_t i = 0; i < nargs; ++i) {
    const bool write = std::find(e.writes.begin(), e.writes.end(), i) != e.writes.end();
    const bool read = !(write && schema.arguments()[i].kwarg_only());
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (is_neuron(t)) a.push_back(touch(t, read, write));
    });
  }
  return a;
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


// ---- Result layouts: what an op returned the first time it ran with an argument signature ----

// How one (flattened) result relates to the arguments, from its first run.
struct ResultSlot {
  enum Kind : uint8_t { none, arg, view, fresh } kind = none;
  int source = -1;  // arg/view: the flat index of the device tensor argument; fresh: the group (one new storage)
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  caffe2::TypeMeta dtype;
  bool conj = false, neg = false;
};
struct Resize {  // an empty out= argument the kernel sized: the launch sizes it (fresh memory, nothing to copy)
  int arg;  // flat index
  std::vector<int64_t> sizes, strides;
  size_t nbytes;
};
struct ResultLayout {
  std::vector<int> list_sizes;  // per return: -1 a single tensor, else the length of its tensor list
  std::vector<Resize> resized;
  std::vector<ResultSlot> slots;
  std::vector<size_t> group_bytes;  // nbytes of each fresh storage
  std::vector<size_t> group_slot;   // the first slot over each fresh storage
  int64_t max_numel = 0;            // of the results: the random ops' draw count, the inline threshold
  bool int64 = false;               // an int64 result: the trainium rules inspect its values
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const noexcept {
    size_t h = k.size();
    for (int64_t x : k) h ^= static_cast<size_t>(x) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};
// A bounded memo in two generations: when `map` is full it becomes `old`, and a signature found in `old` moves back
// into `map`. The signatures in use stay (a loop's shapes recur), and new ones are always remembered: shapes that
// keep changing (a growing KV cache, variable-length batches) never leave an op running on the host thread for good.
struct LayoutCache {
  using Map = std::unordered_map<std::vector<int64_t>, std::shared_ptr<const ResultLayout>, KeyHash>;
  std::shared_mutex mu;
  Map map, old;
  void put(std::vector<int64_t> key, std::shared_ptr<const ResultLayout> L) {  // mu held exclusively
    if (map.size() >= kLayoutsPerOp && !map.count(key)) old = std::move(map), map = Map();
    map.insert_or_assign(std::move(key), std::move(L));
  }
  static constexpr size_t kLayoutsPerOp = 256;  // signatures per generation
};

// The flat device tensor arguments of a call, in order (the indices ResultSlot::source refers to).
using FlatArgs = c10::SmallVector<at::Tensor, 8>;

// The argument signature: everything the results' metadata may depend on (tensor metadata and aliasing, integers,
// flags, dtypes, devices; float values only for factories and out= overloads (`factory`), which have no input tensor
// to shape their result: arange's out= length comes from its start, end and step). False for an argument no layout
// can be keyed by (a CPU tensor of more than 0 dims, an unknown value type).
bool signature(const c10::IValue* args, size_t nargs, bool factory, std::vector<int64_t>& key, FlatArgs& flat) {
  key.reserve(64);
  auto tensor = [&](const at::Tensor& t) -> bool {
    if (!t.defined()) return key.push_back(-1), true;
    if (!is_neuron(t)) {
      if (t.dim() > 0 || t.layout() != at::kStrided) return false;
      key.insert(key.end(), {-2, static_cast<int64_t>(t.scalar_type()), t.unsafeGetTensorImpl()->is_wrapped_number()});
      return true;
    }
    int alias = -1;
    const auto* st = t.storage().unsafeGetStorageImpl();
    for (size_t j = 0; j < flat.size(); ++j)
      if (flat[j].storage().unsafeGetStorageImpl() == st) {
        alias = static_cast<int>(j) * 2 + (flat[j].unsafeGetTensorImpl() == t.unsafeGetTensorImpl());
        break;
      }
    key.insert(key.end(), {static_cast<int64_t>(t.scalar_type()), t.dim(), t.storage_offset(), alias,
                           t.is_conj() * 2 + t.is_neg(), t.requires_grad()});
    key.insert(key.end(), t.sizes().begin(), t.sizes().end());
    key.insert(key.end(), t.strides().begin(), t.strides().end());
    flat.push_back(t);
    return true;
  };
  for (size_t i = 0; i < nargs; ++i) {
    const c10::IValue& v = args[i];
    key.push_back(static_cast<int64_t>(v.tag));
    if (v.isTensor()) {
      if (!tensor(v.toTensor())) return false;
    } else if (v.isTensorList()) {
      key.push_back(static_cast<int64_t>(v.toTensorList().size()));
      for (const at::Tensor& t : v.toTensorList())
        if (!tensor(t)) return false;
    } else if (v.isList()) {
      const auto& l = v.toListRef();
      key.push_back(static_cast<int64_t>(l.size()));
      for (const c10::IValue& x : l) {
        if (x.isTensor()) {
          if (!tensor(x.toTensor())) return false;
        } else if (x.isInt()) {
          key.push_back(x.toInt());
        } else if (x.isBool()) {
          key.push_back(x.toBool());
        } else if (x.isNone()) {
          key.push_back(-3);
        } else if (x.isDouble()) {
          double d = factory ? x.toDouble() : 0.0;
          int64_t bits;
          std::memcpy(&bits, &d, sizeof bits);
          key.push_back(bits);
        } else {
          return false;
        }
      }
    } else if (v.isInt()) {
      key.push_back(v.toInt());
    } else if (v.isBool()) {
      key.push_back(v.toBool());
    } else if (v.isDouble()) {
      if (factory) {
        double d = v.toDouble();
        int64_t bits;
        std::memcpy(&bits, &d, sizeof bits);
        key.push_back(bits);
      }
    } else if (v.isString()) {
      key.push_back(static_cast<int64_t>(std::hash<std::string_view>()(v.toStringView())));
    } else if (v.isDevice()) {
      key.push_back(static_cast<int64_t>(v.toDevice().type()) * 256 + v.toDevice().index());
    } else if (!(v.isNone() || v.isComplexDouble() || v.isGenerator())) {
      return false;
    }
  }
  return true;
}

// The signature's storage, reused by the thread's calls (no allocation per call); a nested call (an op run from
// within another's kernel) finds it taken and uses its own.
struct KeyBuffer {
  static thread_local std::vector<int64_t> spare;
  std::vector<int64_t> key;
  KeyBuffer() { key.swap(spare); }
  ~KeyBuffer() {
    key.clear();
    if (key.capacity() > spare.capacity()) key.swap(spare);
  }
};
thread_local std::vector<int64_t> KeyBuffer::spare;

LayoutCache& layouts_of(OpEntry& e) {
  if (auto* c = static_cast<LayoutCache*>(e.layouts.load(std::memory_order_acquire))) return *c;
  auto* fresh = new LayoutCache;  // never freed: entries live for the process
  void* expected = nullptr;
  if (!e.layouts.compare_exchange_strong(expected, fresh)) {
    delete fresh;
    return *static_cast<LayoutCache*>(expected);
  }
  return *fresh;
}

std::shared_ptr<const ResultLayout> find_layout(OpEntry& e, const std::vector<int64_t>& key) {
  auto& c = layouts_of(e);
  {
    std::shared_lock<std::shared_mutex> g(c.mu);
    if (auto it = c.map.find(key); it != c.map.end()) return it->second;
    if (!c.old.count(key)) return nullptr;
  }
  std::unique_lock<std::shared_mutex> g(c.mu);
  auto it = c.old.find(key);
  if (it == c.old.end()) {  // moved back by another thread meanwhile
    auto cur = c.map.find(key);
    return cur == c.map.end() ? nullptr : cur->second;
  }
  auto L = it->second;
  c.old.erase(it);
  c.put(key, L);
  return L;
}

// Each argument's sizes and strides, and whether it held nothing (no elements, no bytes: a fresh `empty(0)` that an
// out= kernel resizes, which the launch can then size itself).
struct Shape {
  std::vector<int64_t> sizes, strides;
  bool empty;
  bool operator==(const Shape& o) const { return sizes == o.sizes && strides == o.strides; }
};
std::vector<Shape> shapes_of(const FlatArgs& flat) {
  std::vector<Shape> v;
  for (const at::Tensor& t : flat)
    v.push_back({t.sizes().vec(), t.strides().vec(), t.defined() && t.numel() == 0 && t.storage().nbytes() == 0});
  return v;
}

// After a run on the host thread: the layout of its results, or none when they cannot be predicted from the
// signature (a written argument changed shape, a result is not a neuron tensor, an unknown return type).
std::shared_ptr<const ResultLayout> record_layout(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                                                  const FlatArgs& flat, const std::vector<Shape>& before) {
  auto L = std::make_shared<ResultLayout>();
  SmallMap<const c10::StorageImpl*, int> groups;
  auto add = [&](const at::Tensor& t) -> bool {
    ResultSlot s;
    if (!t.defined()) return L->slots.push_back(std::move(s)), true;
    if (!is_neuron(t) || t.layout() != at::kStrided) return false;
    // a result whose storage does not hold its elements (an efficient zero tensor has no memory): only the host
    // path handles it
    if (t.numel() > 0 && (!t.storage().data() || at::detail::computeStorageNbytes(t.sizes(), t.strides(),
                          t.dtype().itemsize(), t.storage_offset()) > t.storage().nbytes()))
      return false;
    L->max_numel = std::max<int64_t>(L->max_numel, t.numel());
    L->int64 |= t.scalar_type() == at::kLong;
    const auto* st = t.storage().unsafeGetStorageImpl();
    for (size_t j = 0; j < flat.size() && s.kind == ResultSlot::none; ++j) {
      if (flat[j].unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) s.kind = ResultSlot::arg, s.source = static_cast<int>(j);
      else if (flat[j].storage().unsafeGetStorageImpl() == st) s.kind = ResultSlot::view, s.source = static_cast<int>(j);
    }
    if (s.kind == ResultSlot::none) {
      s.kind = ResultSlot::fresh;
      if (int* g = groups.find(st)) {
        s.source = *g;
      } else {
        s.source = static_cast<int>(L->group_bytes.size());
        groups.add(st, s.source);
        L->group_bytes.push_back(t.storage().nbytes());
        L->group_slot.push_back(L->slots.size());
      }
    }
    s.sizes.assign(t.sizes().begin(), t.sizes().end());  // an argument's too: the kernel must leave it so
    s.strides.assign(t.strides().begin(), t.strides().end());
    s.offset = t.storage_offset();
    s.dtype = t.dtype();
    s.conj = t.is_conj(), s.neg = t.is_neg();
    L->slots.push_back(std::move(s));
    return true;
  };
  const size_t nret = schema.returns().size();
  for (size_t i = stack.size() - nret; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      L->list_sizes.push_back(-1);
      if (!add(v.toTensor())) return nullptr;
    } else if (v.isTensorList()) {
      L->list_sizes.push_back(static_cast<int>(v.toTensorList().size()));
      for (const at::Tensor& t : v.toTensorList())
        if (!add(t)) return nullptr;
    } else if (v.isNone()) {
      L->list_sizes.push_back(-1);
      L->slots.emplace_back();
    } else {
      return nullptr;
    }
  }
  // written arguments keep their shape, or were empty and sized by the kernel (an out= result: `torch.arange`'s);
  // any other change would need its new shape predicted
  std::vector<Shape> after = shapes_of(flat);
  for (size_t j = 0; j < after.size(); ++j) {
    if (after[j] == before[j]) continue;
    if (!before[j].empty || !flat[j].is_contiguous()) return nullptr;
    L->resized.push_back({static_cast<int>(j), after[j].sizes, after[j].strides, flat[j].storage().nbytes()});
  }
  return L;
}

// A queued kernel's results differ from the layout handed out at its launch (its first call with the same
// argument signature returned another): an op whose results depend on more than the signature. The error says so
// rather than leaving wrong results.
[[noreturn]] void mispredicted(OpEntry& e, const ResultLayout& L, size_t slot, const at::Tensor& got) {
  const ResultSlot& s = L.slots.at(slot);
  TORCH_CHECK(false, "neuron: ", e.name, " returned result ", slot, " as ", got.sizes(), " ", got.dtype(),
              ", but its launch had handed out ", c10::IntArrayRef(s.sizes), " ", s.dtype, " as its first call with "
              "the same argument signature returned; its results are wrong. Please report this; "
              "TORCHNEURON_LAUNCH_BLOCKING=1 runs every op at its launch.");
}

void remember_layout(OpEntry& e, std::vector<int64_t> key, std::shared_ptr<const ResultLayout> L) {
  auto& c = layouts_of(e);
  std::unique_lock<std::shared_mutex> g(c.mu);
  c.put(std::move(key), std::move(L));
}

// The out= overload of a functional op: same name, the same arguments (names and types), then one Tensor(a!)
// keyword argument per result. A queued op with only fresh results computes straight into their device memory
// through it (no copy of the results, no host allocation per call).
const c10::OperatorHandle* out_variant(const c10::OperatorHandle& op, OpEntry& e) {
  if (e.out_looked_up.load(std::memory_order_acquire)) return static_cast<const c10::OperatorHandle*>(e.out_variant.load());
  static std::unordered_map<std::string, std::vector<c10::OperatorName>> by_name;
  static std::once_flag once;
  std::call_once(once, [] {
    for (const auto& n : c10::Dispatcher::singleton().getAllOpNames()) by_name[n.name].push_back(n);
  });
  const auto& f = op.schema();
  const c10::OperatorHandle* found = nullptr;
  // pointwise ops (their functional and out= kernels are one TensorIterator loop) and the op table's structured
  // overloads (one meta and impl for both forms); other out= kernels may use the out as scratch (a reduced loss
  // resized to its unreduced shape) or differ otherwise
  if (!f.returns().empty() && e.writes.empty() &&
      (op.hasTag(at::Tag::pointwise) || e.structured.load(std::memory_order_relaxed))) {
    auto it = by_name.find(f.name());
    for (const auto& n : it == by_name.end() ? std::vector<c10::OperatorName>{} : it->second) {
      auto h = c10::Dispatcher::singleton().findOp(n);
      if (!h || !h->hasKernelForDispatchKey(c10::DispatchKey::CPU)) continue;
      const auto& s = h->schema();
      const auto& fa = f.arguments();
      const auto& sa = s.arguments();
      if (sa.size() != fa.size() + f.returns().size() || s.returns().size() != f.returns().size()) continue;
      bool match = true;
      for (size_t i = 0; i < fa.size() && match; ++i)
        match = sa[i].name() == fa[i].name() && *sa[i].type() == *fa[i].type() && !sa[i].alias_info();
      for (size_t i = fa.size(); i < sa.size() && match; ++i)
        match = sa[i].kwarg_only() && sa[i].alias_info() && sa[i].alias_info()->isWrite() &&
                sa[i].type()->kind() == c10::TypeKind::TensorType;
      for (const auto& r : f.returns()) match &= r.type()->kind() == c10::TypeKind::TensorType;
      if (match) {
        found = new c10::OperatorHandle(*h);  // kept for the process
        break;
      }
    }
  }
  e.out_variant.store(const_cast<c10::OperatorHandle*>(found));
  e.out_looked_up.store(true, std::memory_order_release);
  return found;
}

// A unary list op returning new tensors (`_foreach_sqrt(Tensor[] self) -> Tensor[]`, Adam's every step): the
// CPU's list kernel is the per-tensor functional op in a loop, so the pointwise out= form per tensor (`sqrt.out`)
// is the same kernel, and it writes into the results' device memory instead of fresh memory copied there.
const c10::OperatorHandle* per_tensor_out(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, const c10::OperatorHandle*> memo;  // no lock
  const auto& f = op.schema();
  if (auto it = memo.find(&f); it != memo.end()) return it->second;
  const c10::OperatorHandle* found = nullptr;
  const std::string prefix = "aten::_foreach_";
  auto is_list = [](const c10::TypePtr& t) {
    auto l = t->cast<c10::ListType>();
    return l && l->getElementType()->kind() == c10::TypeKind::TensorType;
  };
  if (f.name().rfind(prefix, 0) == 0 && f.arguments().size() == 1 && f.returns().size() == 1 &&
      is_list(f.arguments()[0].type()) && !f.arguments()[0].alias_info() && is_list(f.returns()[0].type())) {
    auto h = c10::Dispatcher::singleton().findOp({"aten::" + f.name().substr(prefix.size()), "out"});
    if (h && h->hasTag(at::Tag::pointwise) && h->hasKernelForDispatchKey(c10::DispatchKey::CPU)) {
      const auto& a = h->schema().arguments();
      if (a.size() == 2 && a[0].type()->kind() == c10::TypeKind::TensorType && a[1].kwarg_only() &&
          a[1].alias_info() && a[1].alias_info()->isWrite() && h->schema().returns().size() == 1)
        found = new c10::OperatorHandle(*h);  // kept for the process
    }
  }
  memo.emplace(&f, found);
  return found;
}

// Slot k is the first over fresh storage `group` (one Touch per storage).
bool group_slot_is(const ResultLayout& L, int group, size_t k) { return L.group_slot[group] == k; }

at::Tensor tensor_over(const c10::Storage& storage, const ResultSlot& s) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage),
                                                    c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), s.dtype);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(s.sizes, s.strides, s.offset);
  if (s.conj) t._set_conj(true);
  if (s.neg) t._set_neg(true);
  return t;
}

// The op's execution class, from its schema and tags (decided once per op).
OpEntry::Exec classify_exec(const c10::OperatorHandle& op, const OpEntry& e) {
  const auto& schema = op.schema();
  if (op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output) ||
      e.host_tensors.load(std::memory_order_relaxed))
    return OpEntry::Exec::host;
  bool views = !schema.returns().empty();
  for (const auto& r : schema.returns()) {
    auto kind = r.type()->kind();
    bool tensors = kind == c10::TypeKind::TensorType ||
                   (kind == c10::TypeKind::ListType && r.type()->containedType(0)->kind() == c10::TypeKind::TensorType) ||
                   (kind == c10::TypeKind::OptionalType && r.type()->containedType(0)->kind() == c10::TypeKind::TensorType);
    if (!tensors) return OpEntry::Exec::host;  // a number or a bool: read from the results
    views &= r.alias_info() && !r.alias_info()->isWrite();
  }
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
  for (size_t i = 0; i < nargs; ++i) for_each_tensor(args[i], [&](const at::Tensor& t) { work = std::max(work, t.numel()); });
  {
    KernelThreadsGuard threads(thread_work(op, work, args, nargs));
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
      if (int* n = fresh_uses.find(simpl)) ++*n;
      else fresh_uses.add(simpl, 1);
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

// The empty out= arguments the layout sizes at the launch are still empty: nothing to copy, no reader to wait for.
bool sizable_now(const ResultLayout& L, const FlatArgs& flat) {
  for (const Resize& r : L.resized) {
    const at::Tensor& t = flat[r.arg];
    if (t.numel() != 0 || t.storage().nbytes() != 0 || !t.storage().resizable()) return false;
  }
  return true;
}

// The trainium int64 rule for a queued kernel: the int64 values it wrote, looked at on the worker when it ran (the
// warning is given on the user's thread at its next op or sync point).
void check_int64(OpEntry& e, const std::vector<at::Tensor>& written) {
  Int64Range all;  // one event per kernel, as on the host path
  for (const at::Tensor& t : written) {
    if (all.outside) break;
    all = int64_range(t);
  }
  note_int64_queued(e, all);
}

// Queue the op on stream `q` with the results its layout predicts; the kernel runs later over host aliases and
// copies each fresh result into the device memory handed out now. `inspect_int64`: the trainium int64 rule looks at
// the int64 values it writes, when it has run.
void launch_queued(const c10::OperatorHandle& op, torch::jit::Stack* stack, OpEntry& e, Call& c,
                   std::shared_ptr<const ResultLayout> layout, const FlatArgs& flat, StreamQueue& q, int64_t work,
                   bool inspect_int64, Access access) {
  const ResultLayout& L = *layout;
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  c10::IValue* args = stack->data() + (stack->size() - nargs);
  for (const Resize& r : L.resized) {  // empty out= arguments (checked by sizable_now): sized here, as the kernel did
    const at::Tensor& t = flat[r.arg];
    resize_device_storage(*t.storage().unsafeGetStorageImpl(), r.nbytes);
    t.unsafeGetTensorImpl()->set_sizes_and_strides(r.sizes, r.strides);
  }
  std::vector<c10::IValue> host(nargs);
  SmallMap<const c10::TensorImpl*, at::Tensor> same;  // one device tensor passed twice is one CPU tensor twice
  for (size_t i = 0; i < nargs; ++i)
    host[i] = map_tensors(args[i], [&](const at::Tensor& t) -> at::Tensor {
      if (is_neuron(t)) {
        if (at::Tensor* a = same.find(t.unsafeGetTensorImpl())) return *a;
        return same.add(t.unsafeGetTensorImpl(), c.host(t));
      }
      // a 0-dim host value is read at the launch, as CUDA passes it by value (Python numbers are never changed)
      return t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number() ? t.clone() : t;
    });
  for (size_t i : e.generators) {
    if (!host[i].isNone() && !host[i].isGenerator()) continue;
    at::Generator g = host[i].isNone() ? default_generator(c.device) : host[i].toGenerator();
    host[i] = host_generator_of(g);  // drawn in program order, at the launch
    advance_generator(g, static_cast<uint64_t>(L.max_numel));
  }
  // results on the device now; fresh storages filled by the kernel
  std::vector<c10::Storage> groups;
  groups.reserve(L.group_bytes.size());
  for (size_t nbytes : L.group_bytes)
    groups.emplace_back(c10::Storage::use_byte_size_t(), nbytes, neuron_allocator()->allocate(nbytes), neuron_allocator(),
                        /*resizable=*/true);
  std::vector<const void*> expect;  // where an argument or a view result must point (checked by the kernel)
  std::vector<void*> group_memory;
  for (auto& g : groups) group_memory.push_back(g.mutable_data());
  std::vector<at::Tensor> results;
  results.reserve(L.slots.size());
  for (size_t k = 0; k < L.slots.size(); ++k) {
    const ResultSlot& s = L.slots[k];
    switch (s.kind) {
      case ResultSlot::none: results.emplace_back(); break;
      case ResultSlot::arg: results.push_back(flat[s.source]); break;
      case ResultSlot::view: results.push_back(tensor_over(flat[s.source].storage(), s)); break;
      case ResultSlot::fresh: results.push_back(tensor_over(groups[s.source], s)); break;
    }
    bool pointed = (s.kind == ResultSlot::arg || s.kind == ResultSlot::view) && results.back().numel() > 0;
    expect.push_back(pointed ? results.back().data_ptr() : nullptr);
    if (s.kind == ResultSlot::fresh && s.source >= 0 && group_slot_is(L, s.source, k))
      access.push_back(touch(results.back(), false, true));
  }
  std::vector<at::Tensor> int64s;  // host aliases of the int64 tensors it writes: its results and written arguments
  if (inspect_int64) {
    for (const at::Tensor& r : results)
      if (r.defined() && r.scalar_type() == at::kLong) int64s.push_back(host_alias(r));
    for (size_t i : e.writes)
      for_each_tensor(host[i], [&](const at::Tensor& t) { if (t.scalar_type() == at::kLong) int64s.push_back(t); });
  }
  c10::DeviceIndex device = c.device;
  const char* name = e.name.c_str();
  e.queued.fetch_add(1, std::memory_order_relaxed);
  // fresh results each over their own storage, from offset 0: the out= overload writes them in place
  bool outable = !L.slots.empty() && L.group_bytes.size() == L.slots.size();
  for (size_t k = 0; k < L.slots.size() && outable; ++k) outable = L.slots[k].kind == ResultSlot::fresh && L.slots[k].offset == 0;
  const c10::OperatorHandle* out_op = outable ? out_variant(op, e) : nullptr;
  // eager fusion takes functional ops with fresh results and ops in place on `self` (`add_`, `_foreach_mul_`); a
  // list op's size is its whole list's (Adam's runs over every parameter)
  const bool in_place = e.writes.size() == 1 && e.writes[0] == 0 && !schema.arguments()[0].kwarg_only();
  int64_t elements = work;
  size_t list = 0;
  if (host[0].isTensorList()) {
    auto selfs = host[0].toTensorList();
    list = selfs.size(), elements = 0;
    for (const at::Tensor& t : selfs) elements += t.numel();
    elements = std::max(elements, work);
  }
  std::shared_ptr<FusableOp> fuse;
  if ((outable || in_place) && int64s.empty() && fusion_wanted(op, e, elements, list)) {
    fuse = std::make_shared<FusableOp>(FusableOp{op, {}, {}});
    for (const c10::IValue& v : host) {  // a wrapped number enters the group as the number it is
      bool number = v.isTensor() && v.toTensor().unsafeGetTensorImpl()->is_wrapped_number();
      fuse->args.push_back(number ? c10::IValue(v.toTensor().item()) : v);
    }
    if (outable)
      for (const at::Tensor& r : results) fuse->outs.push_back(host_alias(r));
  }
  const c10::OperatorHandle* each_op = outable && !out_op ? per_tensor_out(op) : nullptr;
  if (each_op) {
    std::vector<at::Tensor> outs;
    for (const at::Tensor& r : results) outs.push_back(host_alias(r));
    q.push(name, [each = *each_op, selfs = host[0].toTensorList(), outs = std::move(outs), layout = std::move(layout),
                  device, &e, int64s = std::move(int64s)]() mutable {
      TORCH_INTERNAL_ASSERT(selfs.size() == outs.size(), "neuron: ", e.name, ": a list of another length");
      for (size_t i = 0; i < outs.size(); ++i) {
        torch::jit::Stack st{c10::IValue(selfs.get(i)), c10::IValue(outs[i])};
        with_device_oom(device, [&] { each.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st); });
        const at::Tensor& r = st[0].toTensor();
        if (r.data_ptr() != outs[i].data_ptr() || r.sizes() != c10::IntArrayRef(layout->slots[i].sizes))
          mispredicted(e, *layout, i, r);
      }
      check_int64(e, int64s);
    }, false, std::move(fuse), work, std::move(access));
  } else if (out_op) {
    for (const at::Tensor& r : results) host.push_back(host_alias(r));
    q.push(name, [out = *out_op, host = std::move(host), layout = std::move(layout), device, &e,
                  int64s = std::move(int64s)]() mutable {
      std::vector<const void*> dst;
      for (size_t i = host.size() - out.schema().returns().size(); i < host.size(); ++i) dst.push_back(host[i].toTensor().data_ptr());
      torch::jit::Stack st(std::make_move_iterator(host.begin()), std::make_move_iterator(host.end()));
      with_device_oom(device, [&] { out.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st); });
      for (size_t i = 0; i < dst.size(); ++i) {  // the out= kernel resizes an out it disagrees with
        const at::Tensor& r = st[i].toTensor();
        if (r.data_ptr() != dst[i] || r.sizes() != c10::IntArrayRef(layout->slots[i].sizes)) mispredicted(e, *layout, i, r);
      }
      check_int64(e, int64s);
    }, false, std::move(fuse), work, std::move(access));
  } else
  q.push(name, [op, host = std::move(host), layout = std::move(layout), mem = std::move(group_memory), device, &e,
                expect = std::move(expect), int64s = std::move(int64s)]() mutable {
    torch::jit::Stack st(std::make_move_iterator(host.begin()), std::make_move_iterator(host.end()));
    with_device_oom(device, [&] { op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st); });
    if (mem.empty()) return check_int64(e, int64s);  // arguments and views only: written in place
    std::vector<at::Tensor> out;
    out.reserve(layout->slots.size());
    for (const auto& v : st) {
      if (v.isNone()) out.emplace_back();
      else for_each_tensor(v, [&](const at::Tensor& t) { out.push_back(t); });
    }
    TORCH_INTERNAL_ASSERT(out.size() == layout->slots.size(), "neuron: ", op.schema().name(),
                          " returned a different number of results than at its first call with these arguments");
    for (size_t k = 0; k < out.size(); ++k) {
      const ResultSlot& s = layout->slots[k];
      if (s.kind == ResultSlot::fresh &&
          (!out[k].defined() || out[k].sizes() != c10::IntArrayRef(s.sizes) || out[k].dtype() != s.dtype))
        mispredicted(e, *layout, k, out[k]);
      if (expect[k] && out[k].defined() && out[k].numel() > 0 && out[k].data_ptr() != expect[k])
        mispredicted(e, *layout, k, out[k]);  // handed out as a view (or an argument), computed as fresh memory
      if (s.kind == ResultSlot::arg && out[k].defined() && out[k].sizes() != c10::IntArrayRef(s.sizes))
        mispredicted(e, *layout, k, out[k]);  // the kernel resized an out= argument its launch did not
    }
    e.copied.fetch_add(1, std::memory_order_relaxed);
    for (size_t g = 0; g < mem.size(); ++g) {
      const at::Tensor& r = out[layout->group_slot[g]];
      if (r.storage().nbytes() == layout->group_bytes[g]) {  // the kernel's storage, whole: every view of it
        if (layout->group_bytes[g]) std::memcpy(mem[g], r.storage().data(), layout->group_bytes[g]);
        continue;
      }
      for (size_t k = 0; k < out.size(); ++k) {  // a result the kernel cut from a larger buffer: value by value
        const ResultSlot& s = layout->slots[k];
        if (s.kind != ResultSlot::fresh || s.source != static_cast<int>(g)) continue;
        auto dst = at::from_blob(mem[g], {static_cast<int64_t>(layout->group_bytes[g] / s.dtype.itemsize())},
                                 at::TensorOptions().dtype(s.dtype)).as_strided(s.sizes, s.strides, s.offset);
        dst.copy_(out[k]);
      }
    }
    check_int64(e, int64s);
  }, false, std::move(fuse), work, std::move(access));
  // the results replace the arguments on the stack, as a kernel's would
  stack->erase(stack->end() - static_cast<std::ptrdiff_t>(nargs), stack->end());
  size_t k = 0;
  for (size_t r = 0; r < L.list_sizes.size(); ++r) {
    const int n = L.list_sizes[r];
    if (n < 0) {
      // an undefined result is what the schema returns for it: None for `Tensor?`, an undefined tensor for
      // `Tensor` (layer norm's missing bias gradient), which autograd expects as a tensor
      at::Tensor t = std::move(results[k++]);
      const bool optional = schema.returns()[r].type()->kind() == c10::TypeKind::OptionalType;
      stack->emplace_back(t.defined() || !optional ? c10::IValue(std::move(t)) : c10::IValue());
    } else {
      c10::List<at::Tensor> l;
      l.reserve(n);
      for (int j = 0; j < n; ++j) l.push_back(std::move(results[k++]));
      stack->emplace_back(std::move(l));
    }
  }
}

}  // namespace

void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  warn_deferred();  // int64 events queued kernels found (one relaxed load when there are none)
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  c10::IValue* args = stack->data() + (stack->size() - nargs);
  const bool trainium = trainium_rules();

  OpEntry& e = op_entry(op);
  Call c;
  for (size_t i = 0; i < nargs; ++i) for_each_tensor(args[i], [&](const at::Tensor& t) { check_same_device(c, t, e); });
  for (size_t i = 0; i < nargs; ++i) for_each_tensor(args[i], [&](const at::Tensor& t) { check_host_operand(c, t, e); });
  count_call(e);
  const bool factory = c.device < 0;
  if (factory) c.device = current_device();
  c10::DeviceGuard guard(c10::Device(kNeuron, c.device));

  auto exec = static_cast<OpEntry::Exec>(e.exec.load(std::memory_order_relaxed));
  if (exec == OpEntry::Exec::unknown) e.exec.store(static_cast<uint8_t>(exec = classify_exec(op, e)));
  if (exec == OpEntry::Exec::now) return run_on_host(op, stack, e, c, trainium);  // views: no data read
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
  if (exec == OpEntry::Exec::host || blocking || (trainium && c.fp64)) {
    // A runtime-internal wait, not a sync point: a failure pending on the stream waits for one (this op raises it
    // only if it reads memory the failure left uncomputed). `t[idx]` is no sync point on CUDA either.
    if (!q.idle()) e.waited.fetch_add(1, std::memory_order_relaxed), q.wait_quiet(q.enqueued());
    warn_deferred();  // what the kernels it waited for found
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
  work = thread_work(op, work, args, nargs);
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
  if (L || !keyed) return on_host_now();
  std::vector<Shape> before = shapes_of(flat);  // to see whether the kernel changed a device argument's shape
  on_host_now();
  if (auto recorded = record_layout(schema, *stack, flat, before)) remember_layout(e, std::move(key), std::move(recorded));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>()); }

}  // namespace torchneuron
