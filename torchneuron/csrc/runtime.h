// The modelled NeuronCore runtime shared by the C++ core: device table, current device, policies,
// and the few entry points the files call across each other. One concern per .cpp file; the larger units' interfaces
// have headers of their own (poison.h, queue.h, op_tracking.h, fusion.h), included here.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fusion.h"
#include "op_tracking.h"
#include "poison.h"
#include "queue.h"

namespace torchneuron {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// ---- runtime.cpp: the modelled device table ----
// One capacity per visible logical core; or none and the reason (an invalid configuration): every use of a
// device then raises that reason, while the process itself (CPU work) is unaffected.
void configure_devices(const std::vector<int64_t>& capacities, const std::string& unavailable);
c10::DeviceIndex device_count() noexcept;
int64_t device_capacity(c10::DeviceIndex index);
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);  // validates the index
void check_device_index(c10::DeviceIndex index);  // throws torch.AcceleratorError (as CUDA) naming the valid range

// ---- guard.cpp ----
c10::StreamId current_stream_id(c10::DeviceIndex device);  // this thread's current stream on `device`

// ---- lifecycle.cpp: fork and interpreter exit (docs/device.md, "Fork" and "Exit") ----
enum class Lifecycle : int { running, exiting, forked_child };
extern std::atomic<int> g_lifecycle;
constexpr const char* kBadForkMessage =
    "Cannot re-initialize neuron in forked subprocess. To use neuron with multiprocessing, you must use the 'spawn' "
    "start method";
void install_fork_handler();
// For a device use the process's state forbids: any in a forked child of a parent that had used the device raises
// kBadForkMessage; one from a thread other than the exiting one once the exit-time drain began never returns.
void lifecycle_refuse();
inline void check_device_use() {
  if (C10_UNLIKELY(g_lifecycle.load(std::memory_order_relaxed) != static_cast<int>(Lifecycle::running)))
    lifecycle_refuse();
}
// ---- end lifecycle.cpp ----
// launch_stack.cpp: the Python stack launching a queued kernel (its innermost frames; null on a thread without
// Python frames), and its text for the kernel's error (" It was launched from (most recent call last): ...").
std::shared_ptr<c10::GatheredContext> gather_launch_stack();
std::string describe_launch_stack(const c10::GatheredContext& stack);
// Run `kernel` on the current stream of `device`: queued, or at once when launches block or the stream is idle and
// the work is small (`elements`), where a hand-off to the worker would cost more than the kernel. The kernel must
// not own device memory (capture host aliases: the allocator orders reuse by stream, as CUDA's).
constexpr int64_t kInlineElements = 1 << 15;
// The intra-op threads a kernel launched with `threads` runs with. When they fill the machine's cores, a kernel
// smaller than kFullThreadsWork runs with one thread fewer: the host thread keeps running ahead on that core (with
// every core busy, a parallel kernel whose thread the host preempts waits at its barrier). A rule of the launch
// alone, never of timing, so a kernel's result (a reduction's split follows the thread count) is the same every
// run; off under torch.use_deterministic_algorithms(True), where results equal the CPU's bit for bit. It holds for
// small kernels run inline too: MKL splits even a small matmul, and each parallel region woke a team that sleeps
// once the worker's threads are about.
constexpr int64_t kFullThreadsWork = 1 << 19;
int kernel_threads(int threads, int64_t work);
// A kernel run on the host thread (a signature's first call, a data-dependent op) computes with the threads its
// queued runs would: this sets kernel_threads(current, work) on this thread and restores the count after.
class KernelThreadsGuard {
 public:
  explicit KernelThreadsGuard(int64_t work);
  ~KernelThreadsGuard();
  KernelThreadsGuard(const KernelThreadsGuard&) = delete;
  KernelThreadsGuard& operator=(const KernelThreadsGuard&) = delete;

 private:
  int saved_ = 0;
};
inline bool run_inline(const StreamQueue& q, int64_t elements) {
  return g_launch_blocking.load(std::memory_order_relaxed) ||
         (elements < kInlineElements && !g_queue_everything.load(std::memory_order_relaxed) && q.idle());
}
template <class F>
void launch(c10::DeviceIndex device, const char* name, int64_t elements, Access access, F&& kernel) {
  StreamQueue& q = current_queue(device);
  count_path(Path::kernel);
  if (q.idle()) raise_if_poisoned(access, name);  // else the worker decides: a queued write may make it computed
  if (run_inline(q, elements)) {
    KernelThreadsGuard threads(elements);  // the threads a queued run would take
    kernel();
    clear_poison(access);
  } else {
    q.push(name, std::forward<F>(kernel), false, nullptr, elements, std::move(access));
  }
}

// ---- allocator.cpp: caching device allocator with capacity ----
c10::DeviceAllocator* neuron_allocator();
// Take ownership of host memory a CPU kernel produced for a device tensor (no copy; it is counted as device
// memory from now on and released to the host allocator when freed).
c10::DataPtr adopt_host_memory(c10::DataPtr host, size_t nbytes, c10::DeviceIndex device);
// The device whose memory contains `ptr`, or -1.
c10::DeviceIndex device_of_pointer(const void* ptr);
// Which allocation a device storage's memory is: no other allocation (of that address or any) has the same number,
// so what is recorded against one tensor's memory never reaches the next tensor the allocator puts there. 0 for
// memory the allocator did not hand out.
uint64_t allocation_id(const c10::DataPtr& memory);
bool allocation_holds(const void* ptr, uint64_t allocation);  // that allocation still holds the memory at `ptr`
// A host allocation failure inside a device kernel: counted as the device's out-of-memory and raised (oom.cpp).
[[noreturn]] void raise_host_oom(c10::DeviceIndex device, size_t requested, const std::string& why);

// ---- oom.cpp: torch.OutOfMemoryError as CUDA words it ----
// What the message reports: the request, the core's capacity, this process's limit and fraction, and the bytes
// allocated and reserved.
struct OomReport {
  c10::DeviceIndex device;
  size_t requested, capacity, limit;
  double fraction;
  size_t allocated, reserved;
};
[[noreturn]] void throw_device_oom(const OomReport& r, const char* why);  // why: nullptr for the usual advice
// Run a CPU kernel whose buffers become memory of `device`: a host allocation failure inside it is the device
// running out of memory, so it raises torch.OutOfMemoryError (naming the device) like any device allocation.
[[noreturn]] void throw_host_oom(c10::DeviceIndex device, const c10::Error& host_error);
bool is_host_oom(const c10::Error& e);
template <class F>
decltype(auto) with_device_oom(c10::DeviceIndex device, F&& f) {
  try {
    return f();
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {
    if (is_host_oom(e)) throw_host_oom(device, e);
    throw;
  }
}
// torch.neuron.set_per_process_memory_fraction: this process may reserve at most fraction x capacity.
void set_memory_fraction(c10::DeviceIndex device, double fraction);
double memory_fraction(c10::DeviceIndex device);
// The allocator's blocks (each is its own segment: the allocator never splits), for memory snapshots.
struct BlockView {
  c10::DeviceIndex device;
  uintptr_t address;
  size_t size, requested;
  bool in_use;
};
std::vector<BlockView> allocator_blocks();

// ---- stream_trace.cpp: stream, event and memory events for torch.neuron.stream_check (c10's GPU trace) ----
// Free when no trace is active; they take the GIL when one is, so never call them under the allocator's lock.
// A stream reaches Python as stream_trace_key: (stream id << 8) | device index.
uintptr_t stream_trace_key(const c10::Stream& s);
void trace_event_creation(const void* event);
void trace_event_deletion(const void* event);
void trace_event_record(const void* event, const c10::Stream& s);
void trace_event_wait(const void* event, const c10::Stream& s);
void trace_event_synchronization(const void* event);
void trace_stream_creation(const c10::Stream& s);
void trace_stream_synchronization(const c10::Stream& s);
void trace_device_synchronization();
void trace_memory_allocation(const void* ptr);
void trace_memory_deallocation(const void* ptr);

// ---- memory_history.cpp: allocation history and snapshots (torch.neuron.memory._record_memory_history) ----
enum class MemoryAction { alloc, free_requested, free_completed, segment_alloc, segment_free, oom };
extern std::atomic<bool> g_recording_memory;
// The stack of the current allocation or free, when history recording asks for one (else null). Call it
// before taking the allocator's lock: gathering Python frames may take the GIL.
std::shared_ptr<c10::GatheredContext> memory_context(MemoryAction action);
// Called under the allocator's lock, in the order the allocator acts.
void record_memory_event(MemoryAction action, c10::DeviceIndex device, uintptr_t addr, size_t size,
                         const std::shared_ptr<c10::GatheredContext>& context, size_t device_free = 0);

// ---- hooks.cpp: hooks and generators ----
void register_hooks();
const at::Generator& default_generator(c10::DeviceIndex index);
// Philox4x32-10: the four 32-bit words of counter `counter` under key `seed`. `stream` is the counter's third word:
// 0 for every random op but Bernoulli masks (kMaskStream), so the two never share a counter.
inline std::array<uint32_t, 4> philox(uint64_t seed, uint64_t counter, uint32_t stream = 0) {
  uint32_t c[4] = {static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), stream, 0};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = uint64_t{0xD2511F53} * c[0], p1 = uint64_t{0xCD9E8D57} * c[2];
    uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0, n2 = static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1;
    c[0] = n0, c[1] = static_cast<uint32_t>(p1), c[2] = n2, c[3] = static_cast<uint32_t>(p0);
    k0 += 0x9E3779B9, k1 += 0xBB67AE85;
  }
  return {c[0], c[1], c[2], c[3]};
}
// The same words for a run of counters, eight at a time (AVX2 when the CPU has it; rng.cpp):
// words[k][j] = philox(seed, first + j, stream)[k] for j < n <= kPhiloxChunk.
constexpr int kPhiloxChunk = 256;
void philox_chunk(uint64_t seed, uint64_t first, int n, uint32_t (&words)[4][kPhiloxChunk], uint32_t stream = 0);
// use(i, w0, w1, w2, w3) for i in [0, n), the words of counter first + i.
template <class F>
void for_each_philox(uint64_t seed, uint64_t first, int64_t n, F&& use) {
  uint32_t w[4][kPhiloxChunk];
  for (int64_t base = 0; base < n; base += kPhiloxChunk) {
    const int m = static_cast<int>(std::min<int64_t>(kPhiloxChunk, n - base));
    philox_chunk(seed, first + static_cast<uint64_t>(base), m, w);
    for (int j = 0; j < m; ++j) use(base + j, w[0][j], w[1][j], w[2][j], w[3][j]);
  }
}
// Two words -> a double in the open interval (0, 1) from their 53 high bits: logs and divisions by it are finite.
inline double philox_unit(uint32_t lo, uint32_t hi) {
  return (static_cast<double>(static_cast<int64_t>((static_cast<uint64_t>(hi) << 32 | lo) >> 11)) + 0.5) * 0x1p-53;
}
// A Bernoulli keep test on one 32-bit word w: w * 2^-32 < p, as one integer comparison with ceil(p * 2^32) (exact:
// p * 2^32 is a double's exact product). A mask takes one word per element, four per counter, as CUDA's curand4 does.
struct BelowP {
  explicit BelowP(double p) {  // p in [0, 1] (check_like_cpu)
    const double scaled = std::ceil(std::ldexp(p, 32));
    all = scaled >= 0x1p32, bound = all ? 0 : static_cast<uint32_t>(scaled);  // p within 2^-32 of 1 keeps all too
  }
  bool operator()(uint32_t w) const { return all || w < bound; }
  bool all;        // every word is kept
  uint32_t bound;  // otherwise words below it are kept (0 for p = 0: none)
};
// The counters a random op of n elements owns: element i draws philox(seed, offset + i). Advances the generator
// (the default one of `device` when `gen` is empty) by n rounded up to a multiple of 4, as CUDA's offsets are.
// A generator of another device type is refused with CUDA's message.
struct PhiloxSlice {
  uint64_t seed, offset;
};
PhiloxSlice reserve_philox(const std::optional<at::Generator>& gen, c10::DeviceIndex device, uint64_t n);
// use(i, w0, w1, w2, w3) for i in [0, n) with the words of counter s.offset + i, over the intra-op threads: how
// every counter-based random kernel fills its n elements.
template <class F>
void parallel_philox(PhiloxSlice s, int64_t n, F&& use) {
  at::parallel_for(0, n, 2048, [&](int64_t lo, int64_t hi) {
    for_each_philox(
        s.seed, s.offset + static_cast<uint64_t>(lo), hi - lo,
        [&](int64_t j, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) { use(lo + j, w0, w1, w2, w3); });
  });
}
// out[i] = keep(w) ? kept : dropped for i in [0, n): a Bernoulli mask (dropout's in any float dtype or bool, the
// attention dropout's multiplier) from one word per element. Position g = s.offset + i reads word (g >> 4) & 3 of
// counter (g >> 6) * 16 + (g & 15) in the mask stream: four masks per Philox evaluation (one used to cost 10% of an
// HF GPT-2 training step's stream time), sixteen consecutive elements per vector of words, and still a function of
// (seed, offset + position) alone, as DTensor's shards need. For float, double, c10::Half, c10::BFloat16 and bool
// (rng.cpp).
constexpr uint32_t kMaskStream = 1;
template <class T>
void philox_keep(PhiloxSlice s, int64_t n, const BelowP& keep, T kept, T dropped, T* out);
// Random ops without a counter-based kernel run on the host: a CPU generator seeded from the neuron generator's
// next counter, and the neuron generator then advanced by the op's element count.
at::Generator host_generator_of(const at::Generator& neuron_gen);
void advance_generator(const at::Generator& neuron_gen, uint64_t n);

// ---- policy.cpp: the device policies (docs/device.md: Trainium rules, fallback policy) ----
enum class DtypePolicy : int { trainium, host };
enum class FallbackPolicy : int { warn, silent, error };
// By name ("trainium" | "host", "warn" | "silent" | "error"); an unknown name raises ValueError listing the valid
// ones, and then neither policy changes.
void set_policies(const std::string& dtype, const std::string& fallback);
FallbackPolicy fallback_policy();
// The trainium dtype rules apply to ops on this thread: the policy is `trainium` and no internal math is running.
bool trainium_rules();
// While set on this thread, ops skip the dtype policy: PyTorch's own tensor printing computes its layout in
// float64 and must neither warn about nor count the user's program (the values printed are the device's).
bool set_internal_math(bool on);             // returns the previous value
bool is_fp64(const at::Tensor& t);           // float64 or complex128
void round_to_fp32(const at::Tensor& host);  // the fp64 rule, in place: values keep float32 precision
struct Int64Range {
  int64_t lo = 0, hi = 0;
  bool outside = false;  // some value does not fit int32
};
Int64Range int64_range(const at::Tensor& host);    // empty unless `host` is int64
void note_host_to_device(const at::Tensor& host);  // data entered the device: apply the dtype policy
// `device_tensor` was computed outside the fallback (a collective's reduction): apply the dtype policy to it,
// counted under `name`.
void note_device_result(const std::string& name, const at::Tensor& device_tensor);

// ---- fallback.cpp: the boxed fallback (every op without an explicit kernel runs its ATen CPU kernel) ----
void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// ---- routing.cpp ----
// Ops with both a CPU kernel and a device-generic composite kernel would take the composite on `neuron`
// (a different algorithm, different rounding, and an extra out= round trip). Route them to the CPU kernel
// through the fallback instead, so the device computes exactly what the CPU does; likewise the composites ATen
// guards with a device-type check that excludes PrivateUse1 (`device_checked`, from the op table). Returns how many.
int route_to_cpu_kernels(const std::vector<std::string>& device_checked, const std::vector<std::string>& one_kernel);

// ---- bridge.cpp: device tensors <-> the CPU tensors ATen's kernels compute on (zero-copy both ways) ----
// A CPU tensor that aliases the device tensor's memory (same bytes, sizes, strides, offset): the zero-copy
// bridge onto ATen CPU kernels. Pass `host_storage`, the CPU storage already made for the same device storage
// in this op call, so that all aliases of one device storage share one CPU storage: ATen's overlap checks
// (has_internal_overlap, assert_no_partial_overlap, is_alias_of) compare storages.
at::Tensor host_alias(const at::Tensor& device_tensor, const c10::Storage& host_storage = {});
// The tensors of one op call keyed by pointer: a linear scan over inline storage while there are a few (most calls;
// it allocates nothing), a hash index once there are more than kIndexAfter, so a list op over hundreds of tensors
// (an optimizer step) costs time linear in them, not quadratic. find() returns the first entry added for a key.
template <class K, class V>
struct SmallMap {
  static constexpr size_t kIndexAfter = 16;
  c10::SmallVector<std::pair<K, V>, 6> items;
  std::unordered_map<K, size_t> index;  // key -> position in items, once items outgrew kIndexAfter
  V* find(K k) {
    if (items.size() > kIndexAfter) {
      auto it = index.find(k);
      return it == index.end() ? nullptr : &items[it->second].second;
    }
    for (auto& [key, v] : items)
      if (key == k) return &v;
    return nullptr;
  }
  V& add(K k, V v) {
    items.emplace_back(k, std::move(v));
    if (items.size() == kIndexAfter + 1) {
      for (size_t i = 0; i < items.size(); ++i) index.emplace(items[i].first, i);
    } else if (items.size() > kIndexAfter + 1) {
      index.emplace(k, items.size() - 1);
    }
    return items.back().second;
  }
};

// Within one op call: the CPU aliases of device tensors, one CPU storage per device storage (see host_alias).
struct HostAliases {
  SmallMap<const c10::StorageImpl*, c10::Storage> storages;  // device -> CPU storage
  at::Tensor operator()(const at::Tensor& device_tensor);
};
// The CPU alias of a (defined) neuron tensor; anything else as it is.
at::Tensor on_host(const at::Tensor& t);
std::optional<at::Tensor> on_host(const std::optional<at::Tensor>& t);
// What the device cannot hold about a CPU kernel's result ("" when it is a plain strided tensor): its layout
// (sparse, mkldnn), or "quantized"/"nested" (strided layout, but not a plain TensorImpl over one storage).
std::string unheld_kind(const at::Tensor& host);
// A device tensor over the memory of a CPU tensor produced by a kernel (adopted, no copy).
at::Tensor adopt_host_tensor(const at::Tensor& host, c10::DeviceIndex device);
// A neuron tensor over `storage` with the metadata (and conj/neg bits) of `like`.
at::Tensor device_tensor_like(const c10::Storage& storage, const at::Tensor& like);
// The one routine that changes the size of a device storage (resize_, set_, Storage.resize_, an out= argument a
// CPU kernel resized). `kernel_memory`: host memory a CPU kernel allocated and filled for the storage, adopted as
// its memory without a copy; without it, fresh device memory receives the first min(old, new) bytes.
void resize_device_storage(c10::StorageImpl& storage, size_t nbytes,
                           std::optional<c10::DataPtr> kernel_memory = std::nullopt);
// After a CPU kernel wrote `alias`, the CPU alias of device tensor `dev`: when the kernel resized it, the device
// storage takes the kernel's memory (and the alias keeps viewing it), and `dev` takes the alias's new shape.
void sync_written(const at::Tensor& dev, const at::Tensor& alias);

// ---- kernels.cpp ----
// CUDA's device check for explicit kernels: every defined tensor is on the neuron device of the first neuron
// tensor (returned), else RuntimeError "Expected all tensors to be on the same device, but found at least two
// devices, ...".
c10::DeviceIndex check_same_device(const char* op, at::ArrayRef<at::Tensor> tensors);

// ---- profiler.cpp: device events for torch.profiler (ProfilerActivity.PrivateUse1) ----
extern std::atomic<bool> g_tracing_device;  // a trace of the device is recording
struct KernelRecord;
// One kernel the device executes, kept as a device event while a trace records: construct it with the inputs
// before the kernel runs and call end() with the outputs. With no trace recording it costs one relaxed load.
class KernelEvent {
 public:
  KernelEvent(const char* name, c10::DeviceIndex device, const c10::FunctionSchema* schema,
              c10::ArrayRef<c10::IValue> inputs) {
    if (g_tracing_device.load(std::memory_order_relaxed)) begin(name, device, schema, inputs);
  }
  void end(c10::ArrayRef<c10::IValue> outputs) {
    if (rec_) finish(outputs);
  }
  ~KernelEvent() {
    if (rec_) drop();  // the kernel threw: no event
  }
  KernelEvent(const KernelEvent&) = delete;
  KernelEvent& operator=(const KernelEvent&) = delete;

 private:
  void begin(const char* name, c10::DeviceIndex device, const c10::FunctionSchema* schema,
             c10::ArrayRef<c10::IValue> inputs);
  void finish(c10::ArrayRef<c10::IValue> outputs);
  void drop();
  KernelRecord* rec_ = nullptr;
};

}  // namespace torchneuron
