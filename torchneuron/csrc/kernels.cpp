// The explicit neuron kernels ATen needs beyond the boxed fallback: allocation, copies between devices and
// the host, storage-level ops (resize_, set_), views (metadata only, shared with ATen's own generic
// implementations) and dropout (the CPU kernel would draw from the CPU generator instead of the device's);
// convolution is convolution.cpp.
#include <ATen/EmptyTensor.h>
#include <ATen/TensorIterator.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/_to_copy_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/StorageImpl.h>
#include <torch/library.h>

#include <typeinfo>

#include "runtime.h"

namespace torchneuron {

c10::DeviceIndex check_same_device(const char* op, at::ArrayRef<at::Tensor> tensors) {
  c10::DeviceIndex device = -1;
  for (const at::Tensor& t : tensors)
    if (t.defined() && t.device().type() == kNeuron) {
      device = t.device().index();
      break;
    }
  for (const at::Tensor& t : tensors)
    TORCH_CHECK(!t.defined() || (t.device().type() == kNeuron && t.device().index() == device),
                "Expected all tensors to be on the same device, but found at least two devices, neuron:",
                static_cast<int>(device), " and ", t.device(), "! (in ", op, ")");
  return device;
}

namespace {

bool is_neuron(const at::Tensor& t) { return t.device().type() == kNeuron; }

c10::DeviceIndex target_index(std::optional<at::Device> device) {
  c10::DeviceIndex idx = device && device->has_index() ? device->index() : current_device();
  check_device_index(idx);
  return idx;
}

void check_layout(std::optional<at::Layout> layout) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      !layout || *layout == at::kStrided, "neuron: ", *layout,
      " tensors are not supported; the neuron device holds only strided (dense) and sparse COO tensors");
}

at::Tensor empty_memory_format(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  check_layout(layout);
  c10::DeviceGuard g(c10::Device(kNeuron, target_index(device)));
  return at::detail::empty_generic(size, neuron_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  check_layout(layout);
  c10::DeviceGuard g(c10::Device(kNeuron, target_index(device)));
  return at::detail::empty_strided_generic(size, stride, neuron_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// Copies between neuron devices and the host: both sides are host memory, so the CPU copy kernel does the work
// (dtype conversion, broadcasting, strides). Data entering the device obeys the dtype policy.
// In stream order, on the current stream of the device side (of the destination between devices), as CUDA's:
// a copy to the host waits for the stream's work, except non_blocking into pinned memory, which is queued (the
// values are there after a sync); a copy from the host reads the source at the call (a snapshot, unless
// non_blocking from pinned memory: then it is read when the copy runs) and is queued. Under the trainium dtype rules
// int64 and float64 data entering the device is snapshotted in the device's dtype, checked (and rounded) at the
// call, then queued: a batch of token ids copied every step does not wait for the device.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  warn_deferred();  // int64 events queued kernels found: warned at the next op, a copy to the host included
  TORCH_CHECK(self.layout() == at::kStrided && dst.layout() == at::kStrided,
              "neuron: copies support only strided tensors, got ", self.layout(), " -> ", dst.layout());
  const bool to_device = is_neuron(dst), from_device = is_neuron(self);
  const at::Tensor& on_device = to_device ? dst : self;
  const c10::DeviceIndex dev = on_device.device().index();
  const bool cross_device = to_device && from_device && self.device() != dst.device();
  if (cross_device) drain_current(self.device().index());
  StreamQueue& q = current_queue(dev);
  const bool rules = to_device && !from_device && trainium_rules() && (is_fp64(dst) || dst.scalar_type() == at::kLong);
  const bool now = g_launch_blocking.load(std::memory_order_relaxed) ||
                   g_tracing_device.load(std::memory_order_relaxed) || run_inline(q, dst.numel()) ||
                   (!to_device && !(non_blocking && dst.is_pinned()));
  HostAliases host;  // a copy within one storage shares its CPU storage: ATen's overlap check sees it
  at::Tensor d = to_device ? host(dst) : dst;
  at::Tensor src = from_device ? host(self) : self;
  // The copy's own checks (broadcasting, overlap, self-copy), at the call as on the CPU: building copy_'s iterator
  // over the host aliases runs them without moving data (a queued copy would raise them at a later sync point).
  // A copy run now makes them itself, unless poisoned memory is about: they come before a poisoned read's error.
  const bool same = d.is_alias_of(src) && d.storage_offset() == src.storage_offset() && d.sizes().equals(src.sizes()) &&
                    d.strides().equals(src.strides()) && d.scalar_type() == src.scalar_type() &&
                    d.is_conj() == src.is_conj() && d.is_neg() == src.is_neg();
  if (same) return dst;  // as ATen's copy_: nothing to do
  if (!now || poisoned_storages())
    at::TensorIteratorConfig()
        .add_output(d)
        .add_const_input(src)
        .resize_outputs(false)
        .check_all_same_dtype(false)
        .check_all_same_device(false)
        .build();
  Access acc;
  if (from_device) acc.push_back(touch(self, true, false));
  if (to_device) acc.push_back(touch(dst, false, true));
  if (q.idle()) raise_if_poisoned(acc, "aten::copy_");  // else the worker decides (a queued write may clear it)
  if (now) {
    // a copy to the host is a sync point (the stream's pending error is raised); one to the device is not
    if (to_device)
      q.wait_quiet(q.enqueued());
    else
      drain_current(dev);
    warn_deferred();                        // what the kernels it waited for found
    raise_if_poisoned(acc, "aten::copy_");  // poisoned by the work it waited for: the host never reads such bytes
    KernelEvent event("aten::copy_", dev, nullptr, {self});  // a DMA transfer
    d.copy_(src);
    event.end({dst});
    if (to_device && !from_device) note_host_to_device(d);
    clear_poison(acc);
    return dst;
  }
  if (rules) {  // the trainium rules look at the values entering the device: a snapshot in the device's dtype, now
    src = src.to(dst.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    note_host_to_device(src);
  } else if (!from_device && !(non_blocking && self.is_pinned())) {
    src = src.clone();  // read now: the caller may change it
  }
  const uint64_t copied =
      q.push("aten::copy_", [d, src]() mutable { d.copy_(src); }, false, nullptr, dst.numel(), std::move(acc));
  // Queued on the destination's stream, the copy reads the source device's memory later: the source device's
  // current stream waits for it (as CUDA's copy, run on the source's stream), so neither that stream's next writes
  // nor the source's memory freed and reused there overtake the read (nn.DataParallel's replicas' gradients did).
  if (cross_device)
    current_queue(self.device().index())
        .push(
            "aten::copy_ (wait, cross-device)", [&q, copied] { q.wait_quiet(copied); },
            /*control=*/true);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// resize_ and set_ grow a storage that is too small for the new extent, never shrink it (as on the CPU).
void grow_storage(const c10::Storage& storage, size_t nbytes) {
  if (nbytes > storage.nbytes()) resize_device_storage(*storage.unsafeGetStorageImpl(), nbytes);
}

const at::Tensor& resize_(const at::Tensor& self, at::IntArrayRef size, std::optional<at::MemoryFormat> fmt) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (fmt && *fmt != at::MemoryFormat::Preserve) impl->empty_tensor_restride(*fmt);
  if (self.numel() > 0)
    grow_storage(self.storage(), at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(),
                                                                  self.storage_offset()));
  return self;
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source, int64_t offset, at::IntArrayRef size,
                        at::IntArrayRef stride) {
  // CUDA's (checkSetStorage) message: a tensor never changes device through set_
  TORCH_CHECK(self.storage().is_alias_of(source) || self.storage().device() == source.device(),
              "Attempted to set the storage of a tensor on device \"", self.storage().device(),
              "\" to a storage on different device \"", source.device(),
              "\".  This is no longer allowed; the devices must match.");
  auto* impl = self.unsafeGetTensorImpl();
  if (!self.storage().is_alias_of(source)) impl->set_storage_keep_dtype(source);
  impl->set_sizes_and_strides(size, stride, offset);
  if (self.numel() > 0)
    grow_storage(self.storage(), at::detail::computeStorageNbytes(size, stride, self.dtype().itemsize(), offset));
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, source, 0, {n}, {1});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& src) {
  return set_storage(self, src.storage(), src.storage_offset(), src.sizes(), src.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard g(self.device());
  auto storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, neuron_allocator(), true);
  return set_storage(self, storage, 0, {0}, {});
}

// Mirrors ATen's CPU native_dropout exactly, drawing the mask from the device generator.
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0) return {input.clone(), at::empty_like(input)};
  if (train.has_value() && !*train) return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  double p1m = 1. - p;
  double scale = p1m == 0 ? 0. : 1. / p1m;
  at::Tensor mask = at::empty_like(input, at::MemoryFormat::Contiguous);
  mask.bernoulli_(p1m);
  return {input.mul(mask).mul_(scale), mask};
}

// ATen's dropout takes the fused native_dropout on every accelerator but uses plain bernoulli-and-multiply on the
// CPU. The neuron device follows the CPU's arithmetic (same draws, same rounding, same gradient), so training runs
// match the CPU bit for bit. Registered at the autograd level: the ops below are recorded like any other.
template <bool inplace>
at::Tensor dropout_like_cpu(const at::Tensor& input, double p, bool train) {
  TORCH_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
  if (p == 0 || !train || input.sym_numel() == 0) return input;
  at::Tensor noise = p == 1 ? at::zeros({}, input.options()) : at::empty_like(input).bernoulli_(1 - p);
  if (p != 1) noise.div_(1 - p);
  return inplace ? input.mul_(noise) : input.mul(noise);
}

at::Tensor dropout(const at::Tensor& input, double p, bool train) { return dropout_like_cpu<false>(input, p, train); }
at::Tensor& dropout_(at::Tensor& input, double p, bool train) {
  dropout_like_cpu<true>(input, p, train);
  return input;
}

// Sparse compressed tensors (CSR/CSC/BSR/BSC) are refused at the move, as COO tensors are: ATen would build a
// neuron tensor of that layout without dispatching to the device, and nothing could read it afterwards.
at::Tensor sparse_compressed_to_copy(const at::Tensor& self, std::optional<at::ScalarType> dtype,
                                     std::optional<at::Layout> layout, std::optional<at::Device> device,
                                     std::optional<bool> pin_memory, bool non_blocking,
                                     std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      !device || device->type() != kNeuron, "neuron: ", self.layout(),
      " tensors are not supported; the neuron device holds only strided (dense) and sparse COO tensors "
      "(convert with .to_dense() first)");
  return at::native::_to_copy(self, dtype, layout, device, pin_memory, non_blocking, memory_format);
}

void refuse_sparse_compressed(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "neuron: sparse compressed (CSR/CSC/BSR/BSC) tensors are not supported (in ",
                              op.schema().name(),
                              "); the neuron device holds only strided (dense) and sparse COO tensors");
}

// Quantized and nested tensors: a constructor or a move given device="neuron" dispatches on QuantizedPrivateUse1 /
// NestedTensorPrivateUse1 (an op computing one from neuron tensors is refused by the fallback, fallback.cpp).
void refuse_unheld(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const char* kind = "quantized";
  for (const auto& v : *stack)
    if (v.isTensor() && v.toTensor().is_nested()) kind = "nested";
  TORCH_CHECK_NOT_IMPLEMENTED(false, "neuron: ", kind, " tensors are not supported (in ", op.schema().name(),
                              "); the neuron device holds only strided (dense) and sparse COO tensors: run ", kind,
                              " ops on the CPU");
}

// PyTorch converts a module's parameters in place (`param.data = converted`: Parameter objects, weight ties,
// optimizers and lazy modules' uninitialized parameters survive `.to()`) only when this op says a shallow copy
// between the two tensors is valid. Its built-in answer (TensorImpl::has_compatible_shallow_copy_type) lists
// the dense backends without PrivateUse1 and leaves a PrivateUse1 backend to answer for itself. A dense neuron
// tensor is the same TensorImpl as a dense CPU tensor, so the shallow copy between them is the one CPU<->CUDA
// conversions make.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    const auto ks = t.key_set();
    return ks.has(c10::DispatchKey::Dense) && typeid(*t.unsafeGetTensorImpl()) == typeid(c10::TensorImpl) &&
           (ks.has_backend(c10::BackendComponent::CPUBit) || ks.has_backend(c10::BackendComponent::PrivateUse1Bit));
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) || (dense(self) && dense(from));
}

}  // namespace

TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&refuse_unheld>());
}
TORCH_LIBRARY_IMPL(_, NestedTensorPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&refuse_unheld>());
}

// A move to `neuron` or a constructor given device="neuron" dispatches on SparseCsrPrivateUse1 (BackendSelect adds
// the target's layout and backend), where ATen's composite kernels would build the tensor without the device.
TORCH_LIBRARY_IMPL(aten, SparseCsrPrivateUse1, m) {
  m.impl("_to_copy", sparse_compressed_to_copy);
  for (const char* ctor :
       {"sparse_compressed_tensor.comp_plain_value", "sparse_compressed_tensor.comp_plain_value_size",
        "_sparse_compressed_tensor_unsafe", "_sparse_compressed_tensor_with_dims"})
    m.impl(ctor, torch::CppFunction::makeFromBoxedFunction<&refuse_sparse_compressed>());
}
TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&refuse_sparse_compressed>());
}

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("dropout", dropout);
  m.impl("dropout_", dropout_);
}

// A view kernel (ATen's own: metadata only, at the call), counted as the `now` path.
template <auto Fn>
struct CountedView;
template <class R, class... A, R (*Fn)(A...)>
struct CountedView<Fn> {
  static R call(A... a) {
    count_path(Path::now);
    return Fn(a...);
  }
};

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("view", TORCH_FN(CountedView<&at::native::view>::call));
  m.impl("as_strided", TORCH_FN(CountedView<&at::native::as_strided_tensorimpl>::call));
  m.impl("_reshape_alias", TORCH_FN(CountedView<&at::native::_reshape_alias>::call));
  m.impl("unfold", TORCH_FN(CountedView<&at::native::unfold>::call));
  m.impl("view_as_real", TORCH_FN(CountedView<&at::native::view_as_real>::call));
  m.impl("view_as_complex", TORCH_FN(CountedView<&at::native::view_as_complex>::call));
  m.impl("native_dropout", native_dropout);
}

// Our copies carry conj/neg bits onto the CPU aliases, where ATen's CPU copy resolves them; without these the
// Conjugate/Negative fallbacks would materialise the source with a clone, which copies, which recurses.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

}  // namespace torchneuron
