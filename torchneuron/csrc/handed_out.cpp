// Fresh results made in the launch's memory. A queued kernel with no out= form (layer norm, batch norm, relu, the
// explicit convolution) makes its results with the CPU allocator; while it runs, that allocator hands the blocks its
// launch handed out to its first request of each exact size, instead of fresh memory whose results would then be
// copied in. Installed over the CPU's allocator when the core loads (tensors made before keep theirs); outside such
// a kernel, and on every other thread, it is the CPU's allocator. Only ATen's kernels are run this way: they keep no
// tensor they allocate past their call, where a user's op may (a cached workspace) and would then hold device memory
// the runtime reuses; a block still held after the call raises (check_handed_out_released).
#include "handed_out.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_set>
#include <utility>

namespace torchneuron {
namespace {

struct HandedOut {
  const std::vector<void*>& blocks;
  const std::vector<size_t>& bytes;
  std::vector<char> taken;
};
thread_local HandedOut* t_handed_out = nullptr;

// Blocks handed to an allocation and not yet released by it. A raw allocation (oneDNN's scratch) is released
// through the allocator's raw deleter, which frees only memory that is not a block: every raw CPU deallocation of
// the process passes there, so it takes the lock only while some block is held. A forked child starts with a fresh
// lock and an empty record (a thread that held the lock at the fork does not exist there, and no kernel ran on the
// forking thread): a child's raw deallocations would otherwise wait forever.
std::mutex* g_mu = new std::mutex;
std::unordered_set<void*>* g_held = new std::unordered_set<void*>;
std::atomic<size_t> g_held_count{0};
c10::DeleterFnPtr g_cpu_raw_deleter = nullptr;

bool release(void* p) {
  if (g_held_count.load() == 0) return false;
  std::lock_guard<std::mutex> g(*g_mu);
  if (!g_held->erase(p)) return false;
  g_held_count.fetch_sub(1);
  return true;
}

void release_block(void* p) { release(p); }

void raw_release(void* p) {
  if (!release(p)) g_cpu_raw_deleter(p);
}

class HandingOutCPUAllocator final : public c10::Allocator {
 public:
  explicit HandingOutCPUAllocator(c10::Allocator* cpu) : cpu_(cpu) {}
  c10::DataPtr allocate(size_t n) override {
    if (HandedOut* h = t_handed_out; C10_UNLIKELY(h != nullptr) && n > 0)
      for (size_t g = 0; g < h->blocks.size(); ++g)
        if (!h->taken[g] && h->bytes[g] == n) {
          h->taken[g] = 1;
          {
            std::lock_guard<std::mutex> lock(*g_mu);
            if (g_held->insert(h->blocks[g]).second) g_held_count.fetch_add(1);
          }
          return {h->blocks[g], h->blocks[g], &release_block, c10::Device(c10::DeviceType::CPU)};
        }
    return cpu_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return g_cpu_raw_deleter ? &raw_release : nullptr; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { cpu_->copy_data(dst, src, n); }

 private:
  c10::Allocator* cpu_;
};

const bool g_installed = [] {
  static HandingOutCPUAllocator a(c10::GetCPUAllocator());
  g_cpu_raw_deleter = c10::GetCPUAllocator()->raw_deleter();
  c10::SetCPUAllocator(&a, /*priority=*/0);
  pthread_atfork(nullptr, nullptr, [] {  // the old lock and record are left behind, not destroyed
    g_mu = new std::mutex, g_held = new std::unordered_set<void*>, g_held_count.store(0);
  });
  return true;
}();

}  // namespace

void with_handed_out(const std::vector<void*>& blocks, const std::vector<size_t>& bytes,
                     const std::function<void()>& kernel) {
  HandedOut h{blocks, bytes, std::vector<char>(blocks.size(), 0)};
  struct Scope {
    HandedOut* saved;
    ~Scope() { t_handed_out = saved; }
  } scope{std::exchange(t_handed_out, &h)};
  kernel();
}

int block_of(const at::Tensor& t, const std::vector<void*>& blocks) {
  if (!t.defined()) return -1;
  auto it = std::find(blocks.begin(), blocks.end(), t.storage().data());
  return it == blocks.end() ? -1 : static_cast<int>(it - blocks.begin());
}

void check_handed_out_released(const std::vector<void*>& blocks, const char* name) {
  for (void* b : blocks)
    TORCH_CHECK(!release(b), "neuron: ", name,
                " kept a tensor it allocated past its call; its results may be wrong. Please report this; "
                "TORCHNEURON_LAUNCH_BLOCKING=1 runs every op at its launch.");
}

}  // namespace torchneuron
