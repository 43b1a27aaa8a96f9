// Sparse COO tensors on the device: a SparseTensorImpl whose indices and values are neuron tensors (ATen's own
// backend-agnostic constructors and metadata accessors), and every other sparse op run by the CPU's sparse kernel
// over device memory. The sparse fallback waits for the stream's queued work, gives each sparse argument a
// SparseCPU twin over host aliases of its indices and values (no copy), dense neuron arguments their host aliases,
// runs the op on the calling thread, and brings the results back: dense results and the indices/values of sparse
// ones are copied into device memory; a sparse argument the op changed gets the CPU's new indices and values.
// Compressed layouts (CSR/CSC/BSR/BSC) stay refused (kernels.cpp).
#include <ATen/SparseTensorImpl.h>
#include <ATen/native/SparseTensorUtils.h>
#include <ATen/ops/_coalesced_native.h>
#include <ATen/ops/_indices_native.h>
#include <ATen/ops/_nnz_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_native.h>
#include <ATen/ops/_values_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/dense_dim_native.h>
#include <ATen/ops/empty_native.h>
#include <ATen/ops/indices_native.h>
#include <ATen/ops/is_coalesced_native.h>
#include <ATen/ops/sparse_dim_native.h>
#include <ATen/ops/sparse_resize_and_clear_native.h>
#include <ATen/ops/sparse_resize_native.h>
#include <ATen/ops/values_native.h>
#include <torch/library.h>

#include "runtime.h"

namespace torchneuron {
namespace {

bool is_neuron(const at::Tensor& t) { return t.defined() && t.device().type() == kNeuron; }

// A SparseCPU tensor over host aliases of a neuron COO tensor's indices and values.
at::Tensor sparse_on_host(const at::Tensor& t, HostAliases& alias) {
  return at::_sparse_coo_tensor_with_dims_and_tensors(t.sparse_dim(), t.dense_dim(), t.sizes(), alias(t._indices()),
                                                      alias(t._values()), t.options().device(at::kCPU),
                                                      t.is_coalesced());
}

at::Tensor to_device(const at::Tensor& host, c10::DeviceIndex dev) {
  const c10::Device d(kNeuron, dev);
  if (host.layout() == at::kStrided) return host.to(d);
  TORCH_CHECK_NOT_IMPLEMENTED(host.layout() == at::kSparse, "neuron: ", host.layout(),
                              " tensors are not supported; the neuron device stores strided and sparse COO tensors");
  return at::_sparse_coo_tensor_with_dims_and_tensors(host.sparse_dim(), host.dense_dim(), host.sizes(),
                                                      host._indices().to(d), host._values().to(d),
                                                      host.options().device(d), host.is_coalesced());
}

// An op on a sparse neuron tensor: the CPU's kernel over device memory (see the file comment).
void sparse_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  auto args = torch::jit::last(*stack, nargs);
  c10::DeviceIndex dev = -1;
  for (const auto& v : args)
    if (v.isTensor() && is_neuron(v.toTensor()))
      dev = v.toTensor().device().index();
    else if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList().vec())
        if (is_neuron(t)) dev = t.device().index();
  TORCH_INTERNAL_ASSERT(dev >= 0, "the sparse neuron fallback got no neuron tensor");
  c10::DeviceGuard guard(c10::Device(kNeuron, dev));
  drain_current(dev);
  count_call(op_entry(op));  // a host fallback unless the op table says otherwise; the fallback policy applies

  HostAliases alias;
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;  // (device argument, its host twin)
  auto host = [&](const at::Tensor& t) -> at::Tensor {
    if (!is_neuron(t)) return t;
    at::Tensor h = t.layout() == at::kSparse ? sparse_on_host(t, alias) : alias(t);
    pairs.emplace_back(t, h);
    return h;
  };
  std::vector<at::Tensor> written;  // the device tensors of arguments the op writes
  for (size_t i = 0; i < nargs; ++i) {
    auto& v = (*stack)[stack->size() - nargs + i];
    const auto* info = schema.arguments()[i].alias_info();
    if (info && info->isWrite() && v.isTensor() && is_neuron(v.toTensor())) written.push_back(v.toTensor());
    if (v.isTensor()) {
      v = host(v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list[j] = host(list[j]);
    } else if (v.isList()) {  // Tensor?[]
      auto list = v.toList();
      for (size_t j = 0; j < list.size(); ++j)
        if (list.get(j).isTensor()) list.set(j, host(list.get(j).toTensor()));
    }
  }
  with_device_oom(dev, [&] { op.callBoxed(stack); });

  // Arguments the op changed: a sparse one takes the CPU's new indices and values (a sparse kernel replaces them);
  // a dense one was written through its alias, or resized into new memory.
  for (const at::Tensor& d : written)
    for (auto& [dt, h] : pairs) {
      if (!dt.is_same(d)) continue;
      if (d.layout() == at::kSparse) {
        auto* impl = at::sparse::get_sparse_impl(d);
        impl->raw_resize_(h.sparse_dim(), h.dense_dim(), h.sizes());
        impl->set_indices_and_values_unsafe(h._indices().to(d.device()), h._values().to(d.device()));
        impl->set_coalesced(h.is_coalesced());
      } else {
        sync_written(d, h);
      }
      break;
    }
  const size_t nret = schema.returns().size();
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
    auto& v = (*stack)[i];
    auto back = [&](const at::Tensor& r) -> at::Tensor {
      if (!r.defined() || r.device().type() != at::kCPU) return r;
      for (auto& [d, h] : pairs)
        if (r.is_same(h)) return d;  // an argument returned (in-place and out= ops)
      return to_device(r, dev);
    };
    if (v.isTensor()) {
      v = back(v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list[j] = back(list[j]);
    }
  }
}

// dense -> sparse COO: the CPU's conversion on the host alias, its indices and values brought to the device.
at::Tensor to_sparse(const at::Tensor& self, std::optional<at::Layout> layout, at::OptionalIntArrayRef blocksize,
                     std::optional<int64_t> dense_dim) {
  TORCH_CHECK_NOT_IMPLEMENTED(!layout || *layout == at::kSparse, "neuron: ", *layout,
                              " tensors are not supported; the neuron device stores strided and sparse COO tensors");
  drain_current(self.device().index());
  return to_device(host_alias(self).to_sparse(layout, blocksize, dense_dim), self.device().index());
}
at::Tensor to_sparse_dim(const at::Tensor& self, int64_t sparse_dim) {
  drain_current(self.device().index());
  return to_device(host_alias(self).to_sparse(sparse_dim), self.device().index());
}

}  // namespace

// ATen's own sparse constructors and accessors: backend-agnostic, they build and read the SparseTensorImpl.
TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  m.impl("_sparse_coo_tensor_with_dims_and_tensors", at::native::new_with_dims_and_tensor_sparse_symint);
  m.impl("_sparse_coo_tensor_with_dims", at::native::new_with_dims_sparse);
  m.impl("empty.memory_format", at::native::empty_sparse);
  m.impl("sparse_dim", at::native::sparse_dim_sparse);
  m.impl("dense_dim", at::native::dense_dim_sparse);
  m.impl("_dimI", at::native::sparse_dim_sparse);
  m.impl("_dimV", at::native::dense_dim_sparse);
  m.impl("_nnz", at::native::_nnz_sparse);
  m.impl("_indices", at::native::_indices_sparse);
  m.impl("_values", at::native::_values_sparse);
  m.impl("indices", at::native::indices_sparse);
  m.impl("values", at::native::values_sparse);
  m.impl("is_coalesced", at::native::is_coalesced_sparse);
  m.impl("_coalesced_", at::native::_coalesced_sparse_);
  m.impl("sparse_resize_", at::native::sparse_resize_);
  m.impl("sparse_resize_and_clear_", at::native::sparse_resize_and_clear_);
  m.impl("copy_", at::native::copy_sparse_wrapper_);
}
TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_fallback>());
}
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_to_sparse", to_sparse);
  m.impl("_to_sparse.sparse_dim", to_sparse_dim);
}

}  // namespace torchneuron
