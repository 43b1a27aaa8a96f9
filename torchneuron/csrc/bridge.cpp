// The tensor bridge between device tensors and the ATen CPU kernels that compute them, zero-copy both ways: a CPU
// alias over a device tensor's memory (one CPU storage per device storage within a call, so ATen's overlap checks
// see the real memory), a device tensor over the memory a CPU kernel produced (adopted by the allocator), and the
// one routine that changes the size of a device storage. Used by the fallback, the explicit kernels and the
// compiled-kernel boundary.
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <cstring>

#include "runtime.h"

namespace torchneuron {

at::Tensor host_alias(const at::Tensor& t, const c10::Storage& host_storage) {
  c10::Storage storage = host_storage;
  if (!storage) {
    const auto& st = t.storage();
    storage = c10::Storage(c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), st.nbytes(), c10::DataPtr(st.mutable_data(), c10::Device(c10::kCPU)),
        c10::GetCPUAllocator(), /*resizable=*/true));
  }
  auto a = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                    t.dtype());
  auto* ai = a.unsafeGetTensorImpl();
  ai->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) ai->_set_conj(true);
  if (t.is_neg()) ai->_set_neg(true);
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) ai->set_wrapped_number(true);
  return a;
}

at::Tensor HostAliases::operator()(const at::Tensor& t) {
  const auto* dev = t.storage().unsafeGetStorageImpl();
  if (const c10::Storage* host = storages.find(dev)) return host_alias(t, *host);
  at::Tensor a = host_alias(t);
  storages.add(dev, a.storage());
  return a;
}

at::Tensor on_host(const at::Tensor& t) { return t.defined() && t.device().type() == kNeuron ? host_alias(t) : t; }

std::optional<at::Tensor> on_host(const std::optional<at::Tensor>& t) {
  return t && t->defined() ? std::optional<at::Tensor>(on_host(*t)) : std::nullopt;
}

at::Tensor device_tensor_like(const c10::Storage& storage, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage),
                                                    c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  t._set_conj(like.is_conj());
  t._set_neg(like.is_neg());
  return t;
}

std::string unheld_kind(const at::Tensor& host) {
  if (host.is_quantized()) return std::string("quantized (") + c10::toString(host.scalar_type()) + ")";
  if (host.is_nested()) return "nested";
  if (host.layout() != at::kStrided) return c10::str(host.layout());
  return "";
}

at::Tensor adopt_host_tensor(const at::Tensor& host, c10::DeviceIndex device) {
  std::string kind = unheld_kind(host);
  TORCH_CHECK_NOT_IMPLEMENTED(kind.empty(), "neuron: a kernel returned a ", kind,
                              " tensor, which the neuron device "
                              "cannot hold (it holds only strided dense and sparse COO tensors)");
  auto* simpl = host.storage().unsafeGetStorageImpl();
  size_t nbytes = simpl->nbytes();
  c10::DataPtr data = simpl->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
  simpl->set_nbytes(0);  // the host storage gave its memory away
  auto impl = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                    adopt_host_memory(std::move(data), nbytes, device),
                                                    neuron_allocator(), /*resizable=*/true);
  return device_tensor_like(c10::Storage(std::move(impl)), host);
}

void resize_device_storage(c10::StorageImpl& storage, size_t nbytes, std::optional<c10::DataPtr> kernel_memory) {
  if (kernel_memory) {
    storage.set_data_ptr_noswap(adopt_host_memory(std::move(*kernel_memory), nbytes, storage.device().index()));
  } else {
    TORCH_CHECK(storage.resizable(), "Trying to resize storage that is not resizable");
    c10::DeviceGuard g(storage.device());
    if (storage.nbytes() > 0) {  // the old bytes are copied on this thread (not a sync point: no error raised)
      StreamQueue& q = current_queue(storage.device().index());
      q.wait_quiet(q.enqueued());
    }
    c10::DataPtr fresh = neuron_allocator()->allocate(nbytes);
    if (size_t keep = std::min(nbytes, storage.nbytes())) std::memcpy(fresh.get(), storage.data(), keep);
    storage.set_data_ptr_noswap(std::move(fresh));
  }
  storage.set_nbytes(nbytes);
}

void sync_written(const at::Tensor& dev, const at::Tensor& alias) {
  auto* astore = alias.storage().unsafeGetStorageImpl();
  auto* dstore = dev.storage().unsafeGetStorageImpl();
  // A CPU kernel resizes an output by reallocating its storage (ATen never grows one in place): new memory.
  if (astore->data() != dstore->data()) {
    c10::DataPtr kernel_memory = astore->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
    resize_device_storage(*dstore, astore->nbytes(), std::move(kernel_memory));
    // the alias storage keeps viewing it, so a second written argument over the same storage is in sync
    astore->set_data_ptr_noswap(c10::DataPtr(dstore->mutable_data(), c10::Device(c10::kCPU)));
  }
  if (dev.sizes() != alias.sizes() || dev.strides() != alias.strides() ||
      dev.storage_offset() != alias.storage_offset())
    dev.unsafeGetTensorImpl()->set_sizes_and_strides(alias.sizes(), alias.strides(), alias.storage_offset());
}

}  // namespace torchneuron
