// Device memory of the modelled NeuronCores: host memory handed out under each core's capacity.
// A caching allocator like CUDA's: freed blocks stay reserved for reuse (reserved >= allocated), the cache is
// released before reporting out-of-memory, and every CUDA statistic is kept per device.
// Reuse is stream-ordered, as CUDA's: a freed block is reused at once by later allocations of the stream that
// allocated it (its queue runs them after the work that used it) and by no other stream; used on another stream
// without Tensor.record_stream it may be overwritten while that stream reads it (CUDA's bug, reproduced), with
// record_stream it waits after its free until every recorded stream has run the work queued so far. Memory goes back to
// the host only when no queued work can touch it (emptyCache and the out-of-memory retry synchronize the device first,
// as cudaFree does). Each device has its own state and lock, and a block's free finds it from a header before its
// memory: the op path takes no process-wide lock.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <array>
#include <map>
#include <set>
#include <mutex>
#include <unordered_map>

#include "runtime.h"

namespace torchneuron {
namespace {

using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr size_t kRound = 512;      // allocation granularity, like CUDA's
constexpr size_t kSmall = 1 << 20;  // blocks up to 1 MiB count in the small pool
constexpr size_t kAlign = 64;       // host alignment for vectorised CPU kernels

struct Block {
  void* ptr;
  size_t size;
  size_t requested;
  c10::DeviceIndex device;
  bool in_use;
  c10::DataPtr host;                         // set when the memory was adopted from a CPU kernel
  c10::StreamId stream = 0;                  // the allocating stream
  std::vector<c10::StreamId> recorded = {};  // other streams that used it (Tensor.record_stream)
  uint64_t id = 0;                           // the allocation that holds it now (allocation_id)
};

std::atomic<uint64_t> g_allocations{0};

// A freed block some stream may still use: usable once each queue has reached its ticket.
struct PendingFree {
  Block* block;
  std::vector<std::pair<StreamQueue*, uint64_t>> until;
  bool ready() const {
    for (auto& [q, t] : until)
      if (!q->reached(t)) return false;
    return true;
  }
};

void bump(c10::CachingAllocator::StatArray& s, size_t bytes, bool up) {
  auto pool = static_cast<size_t>(bytes <= kSmall ? StatType::SMALL_POOL : StatType::LARGE_POOL);
  for (size_t i : {static_cast<size_t>(StatType::AGGREGATE), pool}) up ? s[i].increase(bytes) : s[i].decrease(bytes);
}

void delete_block(void* ptr);
void delete_adopted(void* ptr);

// A device's allocator state, under its own lock (as CUDA's per-device allocators): ops on different devices, and
// the frees of one device's kernels, never contend on a process-wide lock.
struct DeviceCache {
  std::mutex mu;
  std::map<uintptr_t, Block*> segments;  // every block of the device, in use or cached, by address
  std::map<c10::StreamId, std::multimap<size_t, Block*>> free;  // cached blocks, per allocating stream
  std::vector<PendingFree> pending;
  DeviceStats stats{};
  double fraction = 1.0;
};

// A block the allocator made carries its Block* in the kAlign bytes before its memory: its free needs no look-up
// (adopted host memory has no header and is found in its device's segments).
Block*& header_of(void* ptr) { return *reinterpret_cast<Block**>(static_cast<char*>(ptr) - kAlign); }

// The block of memory the allocator handed out (nullptr for other memory).
Block* block_of(const c10::DataPtr& m) {
  if (m.get_deleter() == &delete_block) return m.get() ? header_of(m.get()) : nullptr;
  return m.get_deleter() == &delete_adopted ? static_cast<Block*>(m.get_context()) : nullptr;
}

class NeuronAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex dev = current_device();
    check_device_index(dev);
    if (n == 0) return {nullptr, nullptr, &delete_block, c10::Device(kNeuron, dev)};
    size_t size = (n + kRound - 1) / kRound * kRound;
    auto ctx = memory_context(MemoryAction::alloc);
    c10::StreamId stream = current_stream_id(dev);
    DeviceCache& c = cache(dev);
    std::unique_lock<std::mutex> g(c.mu);
    if (!c.pending.empty()) finish_pending(c);
    Block* b = take_cached(c, stream, size);
    if (!b) {
      reserve_or_throw(c, g, dev, size, n, ctx);
      void* base = std::aligned_alloc(kAlign, kAlign + (size + kAlign - 1) / kAlign * kAlign);
      if (!base) throw_oom(c, dev, n, "the host could not provide the memory");
      void* p = static_cast<char*>(base) + kAlign;
      b = new Block{p, size, n, dev, true, {}, stream};
      header_of(p) = b;
      new_segment(c, b, ctx);
    }
    b->requested = n;
    note_alloc(c, b);
    history(MemoryAction::alloc, b, ctx);
    g.unlock();
    trace_memory_allocation(b->ptr);
    return {b->ptr, b->ptr, &delete_block, c10::Device(kNeuron, dev)};
  }

  c10::DataPtr adopt(c10::DataPtr host, size_t n, c10::DeviceIndex dev) {
    void* p = host.get();
    if (n == 0 || !p) return {nullptr, nullptr, &delete_block, c10::Device(kNeuron, dev)};
    auto ctx = memory_context(MemoryAction::alloc);
    c10::StreamId stream = current_stream_id(dev);
    DeviceCache& c = cache(dev);
    std::unique_lock<std::mutex> g(c.mu);
    reserve_or_throw(c, g, dev, n, n, ctx);
    auto* b = new Block{p, n, n, dev, true, std::move(host), stream};
    new_segment(c, b, ctx);
    note_alloc(c, b);
    history(MemoryAction::alloc, b, ctx);
    g.unlock();
    trace_memory_allocation(p);
    return {p, b, &delete_adopted, c10::Device(kNeuron, dev)};  // the context is the block: its free needs no look-up
  }

  void release(Block* b) {
    auto ctx = memory_context(MemoryAction::free_requested);
    DeviceCache& c = cache(b->device);
    std::lock_guard<std::mutex> g(c.mu);
    TORCH_INTERNAL_ASSERT(b->in_use, "neuron: freeing a block that is not in use");
    auto& st = c.stats;
    bump(st.allocation, 1, false), bump(st.active, 1, false);
    bump(st.allocated_bytes, b->size, false), bump(st.active_bytes, b->size, false);
    bump(st.requested_bytes, b->requested, false);
    b->in_use = false;
    history(MemoryAction::free_requested, b, ctx);
    // Adopted host memory goes back to the host allocator (it is not cached): only once its own stream, too, has
    // run what it queued, since a freed block is never reused but its memory would be gone.
    PendingFree p{b, {}};
    if (b->host) p.until.emplace_back(&queue_of(b->device, b->stream), 0);
    for (c10::StreamId s : b->recorded) p.until.emplace_back(&queue_of(b->device, s), 0);
    for (auto& [q, t] : p.until) t = q->enqueued();
    if (p.ready())
      finish(c, b, ctx);
    else
      c.pending.push_back(std::move(p));
  }

  // The block holding any pointer into its memory (device_of).
  Block* find(const void* ptr) {
    auto key = reinterpret_cast<uintptr_t>(ptr);
    for (int d = 0; d <= max_device_.load(std::memory_order_acquire); ++d) {
      DeviceCache& c = devices_[d];
      std::lock_guard<std::mutex> g(c.mu);
      auto it = c.segments.upper_bound(key);
      if (it == c.segments.begin()) continue;
      --it;
      if (key < it->first + it->second->size) return it->second;
    }
    return nullptr;
  }

  // Whether allocation `id` still holds the memory at `ptr` (memory the allocator did not hand out: always).
  bool holds(const void* ptr, uint64_t id) {
    if (!id) return true;
    auto key = reinterpret_cast<uintptr_t>(ptr);
    for (int d = 0; d <= max_device_.load(std::memory_order_acquire); ++d) {
      DeviceCache& c = devices_[d];
      std::lock_guard<std::mutex> g(c.mu);
      if (auto it = c.segments.find(key); it != c.segments.end()) return it->second->in_use && it->second->id == id;
    }
    return false;
  }

  [[noreturn]] void host_oom(c10::DeviceIndex dev, size_t requested, const std::string& why) {
    DeviceCache& c = cache(dev);
    std::lock_guard<std::mutex> g(c.mu);
    c.stats.num_ooms++;
    throw_oom(c, dev, requested, why.c_str());
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }
  // Out of a device storage (a pickled storage, legacy torch.save): a sync point, never of uncomputed memory.
  void copy_data(void* dst, const void* src, std::size_t count) const override {
    if (const Block* b = const_cast<NeuronAllocator*>(this)->find(src)) {
      synchronize_device(b->device);
      raise_if_poisoned(Access{Touch{b->ptr, b->id, true, false, false}}, "a copy of its storage");
    }
    std::memcpy(dst, src, count);
  }
  bool initialized() override { return device_count() > 0; }

  void emptyCache(c10::MempoolId_t = {0, 0}) override {
    for (int d = 0; d <= max_device_.load(std::memory_order_acquire); ++d) {
      std::unique_lock<std::mutex> g(devices_[d].mu);
      release_cached(devices_[d], g, static_cast<c10::DeviceIndex>(d));
    }
  }

  // CUDA's meaning: a block used on another stream is not reused until that stream has run the work queued when the
  // block is freed (release() above).
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    if (!ptr.get()) return;  // empty tensors own no block
    TORCH_CHECK(stream.device_type() == kNeuron, "record_stream: expected a neuron stream, got a ",
                stream.device_type(), " stream");
    check_device_index(stream.device_index());
    Block* b = block_of(ptr);
    TORCH_CHECK(b, "record_stream: the tensor's memory was not allocated by the neuron allocator");
    std::lock_guard<std::mutex> g(cache(b->device).mu);
    TORCH_CHECK(b->in_use, "record_stream: the tensor's memory was not allocated by the neuron allocator");
    if (stream.id() != b->stream && std::find(b->recorded.begin(), b->recorded.end(), stream.id()) == b->recorded.end())
      b->recorded.push_back(stream.id());
  }

  DeviceStats getDeviceStats(c10::DeviceIndex dev) override {
    check_device_index(dev);
    DeviceCache& c = cache(dev);
    std::lock_guard<std::mutex> g(c.mu);
    return c.stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex dev) override {
    check_device_index(dev);
    DeviceCache& c = cache(dev);
    std::lock_guard<std::mutex> g(c.mu);
    auto& st = c.stats;
    for (auto* arr : arrays(st))
      for (auto& s : *arr) s.reset_accumulated();
    st.num_alloc_retries = st.num_ooms = st.num_device_alloc = st.num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex dev) override {
    check_device_index(dev);
    DeviceCache& c = cache(dev);
    std::lock_guard<std::mutex> g(c.mu);
    for (auto* arr : arrays(c.stats))
      for (auto& s : *arr) s.reset_peak();
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex dev) override {
    size_t cap = device_capacity(dev);
    DeviceCache& c = cache(dev);
    std::lock_guard<std::mutex> g(c.mu);
    size_t used = c.stats.reserved_bytes[0].current;
    return {cap > used ? cap - used : 0, cap};
  }

  void set_fraction(c10::DeviceIndex dev, double f) {
    check_device_index(dev);
    DeviceCache& c = cache(dev);
    std::lock_guard<std::mutex> g(c.mu);
    c.fraction = f;
  }
  double get_fraction(c10::DeviceIndex dev) {
    check_device_index(dev);
    DeviceCache& c = cache(dev);
    std::lock_guard<std::mutex> g(c.mu);
    return c.fraction;
  }
  std::vector<BlockView> blocks() {
    std::vector<BlockView> out;
    for (int d = 0; d <= max_device_.load(std::memory_order_acquire); ++d) {
      std::lock_guard<std::mutex> g(devices_[d].mu);
      for (const auto& [addr, b] : devices_[d].segments)
        out.push_back({b->device, addr, b->size, b->requested, b->in_use});
    }
    return out;
  }

 private:
  DeviceCache& cache(c10::DeviceIndex dev) {  // `dev` validated by the caller
    int seen = max_device_.load(std::memory_order_relaxed);
    while (dev > seen && !max_device_.compare_exchange_weak(seen, dev)) {
    }
    return devices_[dev];
  }

  static std::vector<c10::CachingAllocator::StatArray*> arrays(DeviceStats& st) {
    return {&st.allocation,      &st.segment,        &st.active,       &st.inactive_split,
            &st.allocated_bytes, &st.reserved_bytes, &st.active_bytes, &st.inactive_split_bytes,
            &st.requested_bytes};
  }

  void new_segment(DeviceCache& c, Block* b, const std::shared_ptr<c10::GatheredContext>& ctx) {
    c.segments[reinterpret_cast<uintptr_t>(b->ptr)] = b;
    bump(c.stats.segment, 1, true), bump(c.stats.reserved_bytes, b->size, true);
    c.stats.num_device_alloc++;
    history(MemoryAction::segment_alloc, b, ctx);
  }

  // A freed block no queued work can touch any more: cached for its stream, or its host memory released.
  void finish(DeviceCache& c, Block* b, const std::shared_ptr<c10::GatheredContext>& ctx = nullptr) {
    history(MemoryAction::free_completed, b, ctx);
    b->recorded.clear();
    if (b->host)
      drop_segment(c, b);
    else
      c.free[b->stream].emplace(b->size, b);
  }

  void finish_pending(DeviceCache& c) {
    auto done = std::stable_partition(c.pending.begin(), c.pending.end(), [](auto& p) { return !p.ready(); });
    for (auto it = done; it != c.pending.end(); ++it) finish(c, it->block);
    c.pending.erase(done, c.pending.end());
  }

  // Best fit among the stream's cached blocks, accepting at most 2x the request so small tensors do not pin big
  // blocks.
  Block* take_cached(DeviceCache& c, c10::StreamId stream, size_t size) {
    auto pool = c.free.find(stream);
    if (pool == c.free.end()) return nullptr;
    auto it = pool->second.lower_bound(size);
    if (it == pool->second.end() || it->first > 2 * size) return nullptr;
    Block* b = it->second;
    pool->second.erase(it);
    return b;
  }

  void note_alloc(DeviceCache& c, Block* b) {
    b->in_use = true;
    b->id = g_allocations.fetch_add(1, std::memory_order_relaxed) + 1;
    auto& st = c.stats;
    bump(st.allocation, 1, true), bump(st.active, 1, true);
    bump(st.allocated_bytes, b->size, true), bump(st.active_bytes, b->size, true);
    bump(st.requested_bytes, b->requested, true);
  }

  void drop_segment(DeviceCache& c, Block* b) {
    history(MemoryAction::segment_free, b, nullptr);
    c.segments.erase(reinterpret_cast<uintptr_t>(b->ptr));
    bump(c.stats.segment, 1, false), bump(c.stats.reserved_bytes, b->size, false);
    c.stats.num_device_free++;
    if (!b->host) std::free(static_cast<char*>(b->ptr) - kAlign);
    delete b;  // an adopted block's DataPtr returns its memory to the host allocator here
  }

  // Return the device's cached blocks to the host, after synchronizing the device (queued work may still use a block
  // freed in stream order) with the lock `g` holds on `c` released: a queued kernel may free or adopt memory, and
  // the worker would wait for the lock while this thread waits for the worker.
  void release_cached(DeviceCache& c, std::unique_lock<std::mutex>& g, c10::DeviceIndex dev) {
    g.unlock();
    synchronize_device(dev, /*raise=*/false);
    g.lock();
    finish_pending(c);
    for (auto& [stream, pool] : c.free)
      for (auto& [size, b] : pool) drop_segment(c, b);
    c.free.clear();
  }

  bool has_cached(const DeviceCache& c) {
    return std::any_of(c.free.begin(), c.free.end(), [](auto& pool) { return !pool.second.empty(); });
  }

  // Make room for a new segment of `size` bytes within the core's capacity (times the process's memory
  // fraction), or raise torch.OutOfMemoryError.
  void reserve_or_throw(DeviceCache& c, std::unique_lock<std::mutex>& g, c10::DeviceIndex dev, size_t size,
                        size_t requested, const std::shared_ptr<c10::GatheredContext>& ctx) {
    size_t cap = limit(c, dev);
    auto& st = c.stats;
    if (st.reserved_bytes[0].current + size <= cap) return;
    if (has_cached(c) || !c.pending.empty()) {
      st.num_alloc_retries++;
      release_cached(c, g, dev);
      if (st.reserved_bytes[0].current + size <= cap) return;
    }
    st.num_ooms++;
    if (g_recording_memory.load(std::memory_order_relaxed)) {
      size_t used = st.reserved_bytes[0].current;
      record_memory_event(MemoryAction::oom, dev, 0, requested, ctx, cap > used ? cap - used : 0);
    }
    throw_oom(c, dev, requested, nullptr);
  }

  // The bytes this process may reserve on the device.
  size_t limit(const DeviceCache& c, c10::DeviceIndex dev) {
    size_t cap = device_capacity(dev);
    return c.fraction >= 1.0 ? cap : static_cast<size_t>(static_cast<double>(cap) * c.fraction);
  }

  void history(MemoryAction action, const Block* b, const std::shared_ptr<c10::GatheredContext>& ctx) {
    if (g_recording_memory.load(std::memory_order_relaxed))
      record_memory_event(action, b->device, reinterpret_cast<uintptr_t>(b->ptr), b->size, ctx);
  }

  [[noreturn]] void throw_oom(const DeviceCache& c, c10::DeviceIndex dev, size_t requested, const char* why) {
    throw_device_oom({dev, requested, device_capacity(dev), limit(c, dev), c.fraction,
                      static_cast<size_t>(c.stats.allocated_bytes[0].current),
                      static_cast<size_t>(c.stats.reserved_bytes[0].current)},
                     why);
  }

  std::array<DeviceCache, 128> devices_;  // by device index (validated): no hashing on the op path
  std::atomic<int> max_device_{-1};       // the highest device index used so far (what scans visit)
};

NeuronAllocator g_allocator;

void delete_block(void* ptr) {
  trace_memory_deallocation(ptr);
  if (ptr) g_allocator.release(header_of(ptr));
}

void delete_adopted(void* block) {
  trace_memory_deallocation(static_cast<Block*>(block)->ptr);
  g_allocator.release(static_cast<Block*>(block));
}

}  // namespace

c10::DeviceAllocator* neuron_allocator() { return &g_allocator; }

c10::DataPtr adopt_host_memory(c10::DataPtr host, size_t nbytes, c10::DeviceIndex device) {
  return g_allocator.adopt(std::move(host), nbytes, device);
}

c10::DeviceIndex device_of_pointer(const void* ptr) {
  Block* b = g_allocator.find(ptr);
  return b ? b->device : -1;
}

bool allocation_holds(const void* ptr, uint64_t allocation) { return g_allocator.holds(ptr, allocation); }

uint64_t allocation_id(const c10::DataPtr& memory) {  // also of memory wrapped by from_blob (legacy torch.save)
  const Block* b = block_of(memory);
  if (!b && memory.get() && memory.device().type() == kNeuron) b = g_allocator.find(memory.get());
  return b ? b->id : 0;
}

void raise_host_oom(c10::DeviceIndex device, size_t requested, const std::string& why) {
  g_allocator.host_oom(device, requested, why);
}

void set_memory_fraction(c10::DeviceIndex device, double fraction) { g_allocator.set_fraction(device, fraction); }
double memory_fraction(c10::DeviceIndex device) { return g_allocator.get_fraction(device); }

std::vector<BlockView> allocator_blocks() { return g_allocator.blocks(); }

REGISTER_ALLOCATOR(kNeuron, &g_allocator)

}  // namespace torchneuron
