// Memory that was never computed. A kernel that fails on a stream worker leaves its results unwritten (or half
// written); so does every queued kernel that reads such memory, which is therefore skipped. Rather than hand those
// bytes back as values (CUDA's garbage after a device-side error) each device storage such a kernel writes is
// poisoned with the failure: a launch that reads it, a copy to the host and a host-thread op raise the original
// error, naming the failed op and where it was launched. Work that does not depend on it goes on, and a write that
// covers a whole storage (or its free) clears it, so a notebook or a test session recovers without a restart.
// Poison is keyed by the storage's address and its allocation: a tensor freed on the host while kernels writing and
// reading it are still queued (a temporary) keeps its poison for those kernels, while its memory, handed out again at
// once (stream-ordered reuse), is another allocation's, untouched by it. Entries of freed allocations are dropped
// once no queued work can read them (every stream idle).
#include <unordered_map>
#include <vector>

#include "poison.h"
#include "runtime.h"

namespace torchneuron {
namespace {

struct Storage {  // one allocation of a device storage
  const void* base;
  uint64_t allocation;
  bool operator==(const Storage& o) const { return base == o.base && allocation == o.allocation; }
};
struct StorageHash {
  size_t operator()(const Storage& s) const {
    return std::hash<const void*>()(s.base) ^ (s.allocation * 0x9e3779b97f4a7c15ULL);
  }
};
struct Poison {
  std::mutex mu;
  std::unordered_map<Storage, FailurePtr, StorageHash> by_storage;  // why it was not computed
};
Poison& poison() {
  static auto* p = new Poison;  // leaked: workers may poison while statics are destroyed
  return *p;
}
std::atomic<size_t> g_poisoned{0};  // by_storage.size(): lookups cost one relaxed load while nothing is poisoned

template <class E>
bool rethrow_as(const std::exception_ptr& error, const std::string& where) {
  try {
    std::rethrow_exception(error);
  } catch (const E& e) {
    E copy = e;  // the stored error stays as it was: it may be raised again
    copy.add_context(where);
    throw copy;
  } catch (...) {
    return false;
  }
}

}  // namespace

Touch touch(const at::Tensor& t, bool read, bool write) {
  // sparse (and other storage-less) tensors: their values and indices are tensors of their own
  if (!t.defined() || t.layout() != at::kStrided || !t.has_storage()) return {nullptr, 0, read, write, false};
  const c10::Storage& s = t.storage();
  const bool whole = write && s.data() && t.is_non_overlapping_and_dense() &&
                     static_cast<size_t>(t.numel()) * t.dtype().itemsize() == s.nbytes();
  return {s.data(), allocation_id(s.data_ptr()), read, write, whole};
}

Access access(std::initializer_list<at::Tensor> reads, std::initializer_list<at::Tensor> writes) {
  Access a;
  for (const at::Tensor& t : reads)
    if (t.defined() && t.device().type() == kNeuron) a.push_back(touch(t, true, false));
  for (const at::Tensor& t : writes)
    if (t.defined() && t.device().type() == kNeuron) a.push_back(touch(t, false, true));
  return a;
}

// Also a storage already freed on the host: kernels queued before its free may read it (a temporary's consumers).
void poison_writes(const Access& access, const FailurePtr& failure) {
  auto& p = poison();
  std::lock_guard<std::mutex> g(p.mu);
  for (const Touch& t : access)
    if (t.write && t.base) p.by_storage[{t.base, t.allocation}] = failure;
  g_poisoned.store(p.by_storage.size());
}

void clear_poison(const Access& access) {
  if (!g_poisoned.load(std::memory_order_relaxed)) return;
  auto& p = poison();
  std::lock_guard<std::mutex> g(p.mu);
  for (const Touch& t : access)
    if (t.whole && !t.read) p.by_storage.erase({t.base, t.allocation});
  g_poisoned.store(p.by_storage.size(), std::memory_order_relaxed);
}

void forget_freed_poison() {
  if (!g_poisoned.load(std::memory_order_relaxed)) return;
  for (StreamQueue* q : queues_of(-1))
    if (!q->idle()) return;  // a queued kernel may still read a freed allocation
  auto& p = poison();
  std::lock_guard<std::mutex> g(p.mu);
  for (auto it = p.by_storage.begin(); it != p.by_storage.end();)
    it = allocation_holds(it->first.base, it->first.allocation) ? std::next(it) : p.by_storage.erase(it);
  g_poisoned.store(p.by_storage.size(), std::memory_order_relaxed);
}

FailurePtr poisoned(const Access& access) {
  if (!g_poisoned.load(std::memory_order_relaxed)) return nullptr;
  auto& p = poison();
  std::lock_guard<std::mutex> g(p.mu);
  for (const Touch& t : access)
    if (t.read && t.base)
      if (auto it = p.by_storage.find({t.base, t.allocation}); it != p.by_storage.end()) return it->second;
  return nullptr;
}

FailurePtr poisoned(const at::Tensor& t) { return poisoned(Access{touch(t, true, false)}); }

size_t poisoned_storages() { return g_poisoned.load(std::memory_order_relaxed); }

void rethrow_failure(const Failure& f, const std::string& context) {
  std::string where =
      c10::str("neuron: the error above was raised by ", f.name,
               ", run asynchronously on neuron:", static_cast<int>(f.device), " stream ", f.stream, context);
  if (f.stack) where += describe_launch_stack(*f.stack);
  where += "\n(Set TORCHNEURON_LAUNCH_BLOCKING=1 to raise errors at the launching op.)";
  // the original error's type (IndexError stays IndexError in Python), with where it came from
  rethrow_as<c10::IndexError>(f.error, where) || rethrow_as<c10::ValueError>(f.error, where) ||
      rethrow_as<c10::TypeError>(f.error, where) || rethrow_as<c10::NotImplementedError>(f.error, where) ||
      rethrow_as<c10::OutOfMemoryError>(f.error, where) || rethrow_as<c10::LinAlgError>(f.error, where) ||
      rethrow_as<c10::AcceleratorError>(f.error, where) || rethrow_as<c10::Error>(f.error, where);
  try {
    std::rethrow_exception(f.error);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what(), "\n", where);
  }
  TORCH_CHECK(false, "neuron: ", f.name, " failed with an unknown error\n", where);
}

void raise_poisoned(const Failure& f, const char* op) {
  f.reported.store(true);  // seen: the stream's next sync point does not raise it again
  rethrow_failure(f, c10::str(", and ", op, " reads memory that was never computed because of it (written by ",
                              "that op, or by a kernel skipped because it read that op's results)."));
}

void raise_if_poisoned(const Access& access, const char* op) {
  if (FailurePtr f = poisoned(access)) raise_poisoned(*f, op);
}

}  // namespace torchneuron
