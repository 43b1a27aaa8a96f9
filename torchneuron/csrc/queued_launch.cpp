// A call queued on a stream (fallback.h): its results handed out now in the layout of its first call, its kernel run
// later by the stream's worker in one of three forms (docs/device.md's paths): the op's out= overload into the
// results' memory, a list op's per-tensor out= op, or the functional kernel, allocating in the results' memory.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StorageImpl.h>

#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fallback.h"
#include "handed_out.h"

namespace torchneuron::fallback {
namespace {
// The out= overload of a functional op: same name, the same arguments (names and types), then one Tensor(a!)
// keyword argument per result. A queued op with only fresh results computes straight into their device memory
// through it (no copy of the results, no host allocation per call).
const c10::OperatorHandle* out_variant(const c10::OperatorHandle& op, OpEntry& e) {
  if (e.out_looked_up.load(std::memory_order_acquire))
    return static_cast<const c10::OperatorHandle*>(e.out_variant.load());
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
      if (a.size() == 2 && a[0].type()->kind() == c10::TypeKind::TensorType && a[1].kwarg_only() && a[1].alias_info() &&
          a[1].alias_info()->isWrite() && h->schema().returns().size() == 1)
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
}  // namespace

std::vector<at::Tensor> hand_out(const ResultLayout& L, const FlatArgs& flat, std::vector<c10::Storage>& groups) {
  groups.reserve(L.group_bytes.size());
  for (size_t nbytes : L.group_bytes)
    groups.emplace_back(c10::Storage::use_byte_size_t(), nbytes, neuron_allocator()->allocate(nbytes),
                        neuron_allocator(),
                        /*resizable=*/true);
  std::vector<at::Tensor> results;
  results.reserve(L.slots.size());
  for (const ResultSlot& s : L.slots) {
    switch (s.kind) {
      case ResultSlot::none:
        results.emplace_back();
        break;
      case ResultSlot::arg:
        results.push_back(flat[s.source]);
        break;
      case ResultSlot::view:
        results.push_back(tensor_over(flat[s.source].storage(), s));
        break;
      case ResultSlot::fresh:
        results.push_back(tensor_over(groups[s.source], s));
        break;
    }
  }
  return results;
}

bool sizable_now(const ResultLayout& L, const FlatArgs& flat) {
  for (const Resize& r : L.resized) {
    const at::Tensor& t = flat[r.arg];
    if (t.numel() != 0 || t.storage().nbytes() != 0 || !t.storage().resizable()) return false;
  }
  return true;
}

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
    access.push_back(touch(t, false, true));  // its memory exists only now (a skipped kernel poisons it)
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
  std::vector<at::Tensor> results = hand_out(L, flat, groups);
  std::vector<const void*> expect;  // where an argument or a view result must point (checked by the kernel)
  std::vector<void*> group_memory;
  for (auto& g : groups) group_memory.push_back(g.mutable_data());
  for (size_t k = 0; k < L.slots.size(); ++k) {
    const ResultSlot& s = L.slots[k];
    bool pointed = (s.kind == ResultSlot::arg || s.kind == ResultSlot::view) && results[k].numel() > 0;
    expect.push_back(pointed ? results[k].data_ptr() : nullptr);
    if (s.kind == ResultSlot::fresh && s.source >= 0 && group_slot_is(L, s.source, k))
      access.push_back(touch(results[k], false, true));
  }
  std::vector<at::Tensor> int64s;  // host aliases of the int64 tensors it writes: its results and written arguments
  if (inspect_int64) {
    for (const at::Tensor& r : results)
      if (r.defined() && r.scalar_type() == at::kLong) int64s.push_back(host_alias(r));
    for (size_t i : e.writes)
      for_each_tensor(host[i], [&](const at::Tensor& t) {
        if (t.scalar_type() == at::kLong) int64s.push_back(t);
      });
  }
  c10::DeviceIndex device = c.device;
  const char* name = e.name.c_str();
  e.queued.fetch_add(1, std::memory_order_relaxed);
  // fresh results each over their own storage, from offset 0: the out= overload writes them in place
  bool outable = !L.slots.empty() && L.group_bytes.size() == L.slots.size();
  for (size_t k = 0; k < L.slots.size() && outable; ++k)
    outable = L.slots[k].kind == ResultSlot::fresh && L.slots[k].offset == 0;
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
  count_path(each_op ? Path::queued_each : out_op ? Path::queued_out : Path::queued_copy);
  if (each_op) {
    std::vector<at::Tensor> outs;
    for (const at::Tensor& r : results) outs.push_back(host_alias(r));
    q.push(
        name,
        [each = *each_op, selfs = host[0].toTensorList(), outs = std::move(outs), layout = std::move(layout), device,
         &e, int64s = std::move(int64s)]() mutable {
          TORCH_INTERNAL_ASSERT(selfs.size() == outs.size(), "neuron: ", e.name, ": a list of another length");
          for (size_t i = 0; i < outs.size(); ++i) {
            torch::jit::Stack st{c10::IValue(selfs.get(i)), c10::IValue(outs[i])};
            with_device_oom(device, [&] { each.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st); });
            const at::Tensor& r = st[0].toTensor();
            if (r.data_ptr() != outs[i].data_ptr() || r.sizes() != c10::IntArrayRef(layout->slots[i].sizes))
              mispredicted(e, *layout, i, r);
          }
          check_int64(e, int64s);
        },
        false, std::move(fuse), work, std::move(access));
  } else if (out_op) {
    for (const at::Tensor& r : results) host.push_back(host_alias(r));
    q.push(
        name,
        [out = *out_op, host = std::move(host), layout = std::move(layout), device, &e,
         int64s = std::move(int64s)]() mutable {
          std::vector<const void*> dst;
          for (size_t i = host.size() - out.schema().returns().size(); i < host.size(); ++i)
            dst.push_back(host[i].toTensor().data_ptr());
          torch::jit::Stack st(std::make_move_iterator(host.begin()), std::make_move_iterator(host.end()));
          with_device_oom(device, [&] { out.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st); });
          for (size_t i = 0; i < dst.size(); ++i) {  // the out= kernel resizes an out it disagrees with
            const at::Tensor& r = st[i].toTensor();
            if (r.data_ptr() != dst[i] || r.sizes() != c10::IntArrayRef(layout->slots[i].sizes))
              mispredicted(e, *layout, i, r);
          }
          check_int64(e, int64s);
        },
        false, std::move(fuse), work, std::move(access));
  } else {
    q.push(
        name,
        [op, host = std::move(host), layout = std::move(layout), mem = std::move(group_memory), device, &e,
         expect = std::move(expect), int64s = std::move(int64s)]() mutable {
          torch::jit::Stack st(std::make_move_iterator(host.begin()), std::make_move_iterator(host.end()));
          auto run = [&] {
            with_device_oom(device, [&] { op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st); });
          };
          if (mem.empty()) {  // arguments and views only: written in place
            run();
            return check_int64(e, int64s);
          }
          const bool hand_out = op.operator_name().name.rfind("aten::", 0) == 0;  // ATen's kernels only
          if (hand_out)
            with_handed_out(mem, layout->group_bytes, run);
          else
            run();
          std::vector<at::Tensor> out;
          out.reserve(layout->slots.size());
          for (const auto& v : st) {
            if (v.isNone())
              out.emplace_back();
            else
              for_each_tensor(v, [&](const at::Tensor& t) { out.push_back(t); });
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
          // Where each result was made (handed_out.h): in its own block (done), elsewhere (copied in: the kernel asked
          // for its size first for scratch), or in another result's block (every result read, cloned, before any block
          // is written).
          bool misplaced = false;
          for (size_t k = 0; k < out.size(); ++k) {
            const int b = block_of(out[k], mem);
            misplaced |= layout->slots[k].kind == ResultSlot::fresh && b >= 0 && b != layout->slots[k].source;
          }
          if (misplaced)
            for (at::Tensor& t : out)
              if (block_of(t, mem) >= 0) t = t.clone();
          bool copied = false;
          for (size_t g = 0; g < mem.size(); ++g) {
            const at::Tensor& r = out[layout->group_slot[g]];
            if (block_of(r, mem) == static_cast<int>(g)) continue;  // made where it was handed out
            copied = true;
            if (r.storage().nbytes() == layout->group_bytes[g]) {  // the kernel's storage, whole: every view of it
              if (layout->group_bytes[g]) std::memcpy(mem[g], r.storage().data(), layout->group_bytes[g]);
              continue;
            }
            for (size_t k = 0; k < out.size(); ++k) {  // a result the kernel cut from a larger buffer: value by value
              const ResultSlot& s = layout->slots[k];
              if (s.kind != ResultSlot::fresh || s.source != static_cast<int>(g)) continue;
              auto dst = at::from_blob(mem[g], {static_cast<int64_t>(layout->group_bytes[g] / s.dtype.itemsize())},
                                       at::TensorOptions().dtype(s.dtype))
                             .as_strided(s.sizes, s.strides, s.offset);
              dst.copy_(out[k]);
            }
          }
          if (copied) e.copied.fetch_add(1, std::memory_order_relaxed);
          if (hand_out) {
            st.clear(), out.clear();
            check_handed_out_released(mem, e.name.c_str());
          }
          check_int64(e, int64s);
        },
        false, std::move(fuse), work, std::move(access));
  }
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

}  // namespace torchneuron::fallback
