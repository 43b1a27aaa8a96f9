// Result layouts (fallback.h): what an op returned the first time it ran with an argument signature, remembered per
// op in a bounded memo, so that later calls with that signature can be queued with their results handed out at
// once.
#include <ATen/EmptyTensor.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>

#include <shared_mutex>
#include <unordered_map>

#include "fallback.h"
#include "signature.h"

namespace torchneuron::fallback {
namespace {
// An op's result layouts by argument signature (signature.h's two-generation memo).
struct LayoutCache {
  std::shared_mutex mu;
  SignatureMemo<std::shared_ptr<const ResultLayout>> memo{256};  // signatures per generation
};

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
}  // namespace

namespace {
// The layout memo's policy (signature.h): a device tensor's memory enters as its storage offset and the earlier flat
// argument over the same storage (results may alias arguments); integers and flags by value, floats only for
// factories (`factory`).
struct LayoutKeyer {
  std::vector<int64_t>& key;
  FlatArgs& flat;
  bool factory;
  SmallMap<const c10::StorageImpl*, int> first;  // the first flat tensor over each storage
  bool tensor(const at::Tensor& t) {
    if (!t.defined()) return put(key, Token::undefined_tensor), true;
    if (!is_neuron(t)) {
      if (t.dim() > 0 || t.layout() != at::kStrided) return false;
      put(key, Token::host_scalar);
      key.insert(key.end(), {static_cast<int64_t>(t.scalar_type()), t.unsafeGetTensorImpl()->is_wrapped_number()});
      return true;
    }
    int alias = -1;
    const auto* st = t.storage().unsafeGetStorageImpl();
    if (const int* j = first.find(st))
      alias = *j * 2 + (flat[*j].unsafeGetTensorImpl() == t.unsafeGetTensorImpl());
    else
      first.add(st, static_cast<int>(flat.size()));
    put(key, Token::tensor);
    key.insert(key.end(), {t.storage_offset(), alias, t.is_conj() * 2 + t.is_neg(), t.requires_grad()});
    put_tensor_meta(key, t);
    flat.push_back(t);
    return true;
  }
  void number(const c10::IValue& v) {
    if (v.isInt())
      key.push_back(v.toInt());
    else if (v.isBool())
      key.push_back(v.toBool());
    else if (factory)
      key.push_back(bits_of(v.toDouble()));
  }
};
}  // namespace

bool signature(const c10::IValue* args, size_t nargs, bool factory, std::vector<int64_t>& key, FlatArgs& flat) {
  key.reserve(64);
  key.push_back(c10::GradMode::is_enabled());  // what a kernel returns may depend on it (Task::grad, queue.h)
  LayoutKeyer k{key, flat, factory, {}};
  for (size_t i = 0; i < nargs; ++i)
    if (!put_value(args[i], k)) return false;
  return true;
}

thread_local std::vector<int64_t> KeyBuffer::spare;

std::shared_ptr<const ResultLayout> find_layout(OpEntry& e, const std::vector<int64_t>& key) {
  auto& c = layouts_of(e);
  {
    std::shared_lock<std::shared_mutex> g(c.mu);
    if (const auto* L = c.memo.recent(key)) return *L;
    if (!c.memo.aging(key)) return nullptr;
  }
  std::unique_lock<std::shared_mutex> g(c.mu);
  const auto* L = c.memo.find(key);
  return L ? *L : nullptr;
}

std::vector<Shape> shapes_of(const FlatArgs& flat) {
  std::vector<Shape> v;
  for (const at::Tensor& t : flat)
    v.push_back({t.sizes().vec(), t.strides().vec(), t.defined() && t.numel() == 0 && t.storage().nbytes() == 0});
  return v;
}

namespace {
// Records each result's slot in a layout: over an argument's storage (that argument, or a view of it), or over fresh
// storage (one group per storage, in the order first met).
struct SlotRecorder {
  ResultLayout& L;
  const FlatArgs& flat;
  SmallMap<const c10::StorageImpl*, int> groups, first;  // fresh storages' groups; the first argument over each
  SlotRecorder(ResultLayout& layout, const FlatArgs& args) : L(layout), flat(args) {
    for (size_t j = 0; j < flat.size(); ++j)
      if (flat[j].defined() && !first.find(flat[j].storage().unsafeGetStorageImpl()))
        first.add(flat[j].storage().unsafeGetStorageImpl(), static_cast<int>(j));
  }
  bool add(const at::Tensor& t) {
    ResultSlot s;
    if (!t.defined()) return L.slots.push_back(std::move(s)), true;
    if (!is_neuron(t) || t.layout() != at::kStrided) return false;
    // a result whose storage does not hold its elements (an efficient zero tensor has no memory): only the host
    // path handles it
    if (t.numel() > 0 &&
        (!t.storage().data() || at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.dtype().itemsize(),
                                                                 t.storage_offset()) > t.storage().nbytes()))
      return false;
    L.max_numel = std::max<int64_t>(L.max_numel, t.numel());
    L.int64 |= t.scalar_type() == at::kLong;
    const auto* st = t.storage().unsafeGetStorageImpl();
    if (const int* j = first.find(st))  // the first argument over its storage: that argument, or a view of it
      s.kind = flat[*j].unsafeGetTensorImpl() == t.unsafeGetTensorImpl() ? ResultSlot::arg : ResultSlot::view,
      s.source = *j;
    if (s.kind == ResultSlot::none) {
      s.kind = ResultSlot::fresh;
      if (int* g = groups.find(st)) {
        s.source = *g;
      } else {
        s.source = static_cast<int>(L.group_bytes.size());
        groups.add(st, s.source);
        L.group_bytes.push_back(t.storage().nbytes());
        L.group_slot.push_back(L.slots.size());
      }
    }
    s.sizes.assign(t.sizes().begin(), t.sizes().end());  // an argument's too: the kernel must leave it so
    s.strides.assign(t.strides().begin(), t.strides().end());
    s.offset = t.storage_offset();
    s.dtype = t.dtype();
    s.conj = t.is_conj(), s.neg = t.is_neg();
    L.slots.push_back(std::move(s));
    return true;
  }
};
}  // namespace

std::shared_ptr<const ResultLayout> record_results(const std::vector<std::optional<at::Tensor>>& results,
                                                   const FlatArgs& flat) {
  auto L = std::make_shared<ResultLayout>();
  SlotRecorder rec(*L, flat);
  for (const auto& r : results) {
    L->list_sizes.push_back(-1);
    if (!rec.add(r ? *r : at::Tensor())) return nullptr;
  }
  return L;
}

std::shared_ptr<const ResultLayout> record_layout(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                                                  const FlatArgs& flat, const std::vector<Shape>& before) {
  auto L = std::make_shared<ResultLayout>();
  SlotRecorder rec(*L, flat);
  const size_t nret = schema.returns().size();
  for (size_t i = stack.size() - nret; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      L->list_sizes.push_back(-1);
      if (!rec.add(v.toTensor())) return nullptr;
    } else if (v.isTensorList()) {
      L->list_sizes.push_back(static_cast<int>(v.toTensorList().size()));
      for (const at::Tensor& t : v.toTensorList())
        if (!rec.add(t)) return nullptr;
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

[[noreturn]] void mispredicted(OpEntry& e, const ResultLayout& L, size_t slot, const at::Tensor& got) {
  const ResultSlot& s = L.slots.at(slot);
  TORCH_CHECK(false, "neuron: ", e.name, " returned result ", slot, " as ", got.sizes(), " ", got.dtype(),
              ", but its launch had handed out ", c10::IntArrayRef(s.sizes), " ", s.dtype,
              " as its first call with "
              "the same argument signature returned; its results are wrong. Please report this; "
              "TORCHNEURON_LAUNCH_BLOCKING=1 runs every op at its launch.");
}

void remember_layout(OpEntry& e, std::vector<int64_t> key, std::shared_ptr<const ResultLayout> L) {
  auto& c = layouts_of(e);
  std::unique_lock<std::shared_mutex> g(c.mu);
  c.memo.put(std::move(key), std::move(L));
}
}  // namespace torchneuron::fallback
