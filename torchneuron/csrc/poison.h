// poison.cpp's interface: failures of queued kernels and the memory they left uncomputed.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <exception>
#include <initializer_list>
#include <memory>
#include <string>

namespace torchneuron {

// ---- poison.cpp: memory that was never computed (a failed kernel's results, and those of the kernels skipped
// because they read them) ----
// A failed kernel's error, with the op's name, where it ran and the Python stack that launched it.
struct Failure {
  std::exception_ptr error;
  const char* name = "";
  std::shared_ptr<c10::GatheredContext> stack;
  c10::DeviceIndex device = 0;
  c10::StreamId stream = 0;
  mutable std::atomic<bool> reported{false};  // the user has seen it (a sync point or a poisoned read): not again
};
using FailurePtr = std::shared_ptr<const Failure>;
// One device storage a queued kernel reads and/or writes, by its data pointer (the host aliases' too) and which
// allocation of that memory it is (allocation_id). `whole`: the write covers every byte of the storage, so a kernel
// that writes it without reading it makes it computed again.
struct Touch {
  const void* base = nullptr;
  uint64_t allocation = 0;
  bool read = false, write = false, whole = false;
};
using Access = c10::SmallVector<Touch, 6>;
Touch touch(const at::Tensor& t, bool read, bool write);
// An explicit kernel's: the neuron tensors it reads and those it writes (others are ignored).
Access access(std::initializer_list<at::Tensor> reads, std::initializer_list<at::Tensor> writes);
void poison_writes(const Access& access, const FailurePtr& failure);  // what a failed or skipped kernel writes
void clear_poison(const Access& access);  // a kernel ran: the storages it wrote whole without reading are computed
// Drop the poison of storages freed since it was recorded, when every stream is idle (no queued kernel can read
// them any more): at device synchronizations.
void forget_freed_poison();
FailurePtr poisoned(const Access& access);  // the failure behind the first poisoned storage it reads, or null
FailurePtr poisoned(const at::Tensor& t);
size_t poisoned_storages();
// Raise `f`'s error again, as its own type (IndexError stays IndexError), with where it ran, then `context`.
[[noreturn]] void rethrow_failure(const Failure& f, const std::string& context);
// A launch (or a host read) of `op` that reads poisoned memory raises the failure behind it, at the call.
void raise_if_poisoned(const Access& access, const char* op);
[[noreturn]] void raise_poisoned(const Failure& f, const char* op);

}  // namespace torchneuron
