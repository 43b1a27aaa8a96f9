// The boxed fallback's units, private to them: fallback.cpp (the entry point: checks, the path of each call, host
// execution), layout.cpp (the result layout each argument signature had at its first call) and queued_launch.cpp
// (a call queued on a stream in one of its three kernel forms). Nothing outside these files includes it.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <memory>
#include <vector>

#include "runtime.h"

namespace torchneuron::fallback {
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
    for (const c10::IValue& x : in.vec())
      out.push_back(x.isTensor() ? std::optional<at::Tensor>(f(x.toTensor())) : std::nullopt);
    return out;
  }
  return v;
}

inline bool is_neuron(const at::Tensor& t) { return t.defined() && t.device().type() == kNeuron; }

// Everything a call learns while preparing the CPU arguments, used to map the results back.
struct Call {
  c10::DeviceIndex device = -1;
  bool fp64 = false;     // a float64 device tensor takes part: host values entering the op obey the fp64 rule
  bool entered = false;  // such a host value lost precision on the way in
  HostAliases host;      // one CPU storage per device storage, so ATen's overlap checks see the real memory
  SmallMap<const c10::StorageImpl*, c10::Storage> alias_to_device;           // CPU alias storage -> device storage
  SmallMap<const c10::TensorImpl*, at::Tensor> alias_to_tensor;              // CPU alias tensor -> device tensor
  SmallMap<const c10::TensorImpl*, const c10::TensorImpl*> tensor_to_alias;  // and back
};

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
  int arg;       // flat index
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

// The flat device tensor arguments of a call, in order (the indices ResultSlot::source refers to).
using FlatArgs = c10::SmallVector<at::Tensor, 8>;

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

// Each argument's sizes and strides, and whether it held nothing (no elements, no bytes: a fresh `empty(0)` that an
// out= kernel resizes, which the launch can then size itself).
struct Shape {
  std::vector<int64_t> sizes, strides;
  bool empty;
  bool operator==(const Shape& o) const { return sizes == o.sizes && strides == o.strides; }
};

// ---- layout.cpp ----
// The argument signature: everything the results' metadata may depend on (tensor metadata and aliasing, integers,
// flags, dtypes, devices; float values only for factories and out= overloads (`factory`), which have no input tensor
// to shape their result: arange's out= length comes from its start, end and step). False for an argument no layout
// can be keyed by (a CPU tensor of more than 0 dims, an unknown value type).
bool signature(const c10::IValue* args, size_t nargs, bool factory, std::vector<int64_t>& key, FlatArgs& flat);
// The layout recorded for `key`, or null.
std::shared_ptr<const ResultLayout> find_layout(OpEntry& e, const std::vector<int64_t>& key);
void remember_layout(OpEntry& e, std::vector<int64_t> key, std::shared_ptr<const ResultLayout> L);
std::vector<Shape> shapes_of(const FlatArgs& flat);
// After a run on the host thread: the layout of its results, or none when they cannot be predicted from the
// signature (a written argument changed shape, a result is not a neuron tensor, an unknown return type).
std::shared_ptr<const ResultLayout> record_layout(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                                                  const FlatArgs& flat, const std::vector<Shape>& before);
// A compiled kernel's results (compiler/kernel.py), learnt from its first call's neuron results as an op's are from
// its stack: each over one of `flat` (its neuron inputs) or over fresh storage. Null as record_layout's.
std::shared_ptr<const ResultLayout> record_results(const std::vector<std::optional<at::Tensor>>& results,
                                                   const FlatArgs& flat);
// A queued kernel's results, handed out at its launch: over `flat` and over fresh neuron storages, one per group
// (filled in `groups`), on the current device.
std::vector<at::Tensor> hand_out(const ResultLayout& L, const FlatArgs& flat, std::vector<c10::Storage>& groups);
// A queued kernel's results differ from the layout handed out at its launch (its first call with the same
// argument signature returned another): an op whose results depend on more than the signature. The error says so
// rather than leaving wrong results.
[[noreturn]] void mispredicted(OpEntry& e, const ResultLayout& L, size_t slot, const at::Tensor& got);

// ---- queued_launch.cpp ----
// The empty out= arguments the layout sizes at the launch are still empty: nothing to copy, no reader to wait for.
bool sizable_now(const ResultLayout& L, const FlatArgs& flat);
// Queue the op on stream `q` with the results its layout predicts; the kernel runs later over host aliases and
// copies each fresh result into the device memory handed out now. `inspect_int64`: the trainium int64 rule looks at
// the int64 values it writes, when it has run.
void launch_queued(const c10::OperatorHandle& op, torch::jit::Stack* stack, OpEntry& e, Call& c,
                   std::shared_ptr<const ResultLayout> layout, const FlatArgs& flat, StreamQueue& q, int64_t work,
                   bool inspect_int64, Access access);

}  // namespace torchneuron::fallback
