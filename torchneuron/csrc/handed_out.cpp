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
// through the allocator's raw deleter, which frees only memory that is not a block.
std::mutex g_mu;
std::unordered_set<void*> g_held;
c10::DeleterFnPtr g_cpu_raw_deleter = nullptr;

void release_block(void* p) {
  std::lock_guard<std::mutex> g(g_mu);
  g_held.erase(p);
}

void raw_release(void* p) {
  {
    std::lock_guard<std::mutex> g(g_mu);
    if (g_held.erase(p)) return;
  }
  g_cpu_raw_deleter(p);
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
            std::lock_guard<std::mutex> lock(g_mu);
            g_held.insert(h->blocks[g]);
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

void check_handed_out_released(const std::vector<void*>& blocks, const char* name) {
  std::lock_guard<std::mutex> g(g_mu);
  for (void* b : blocks)
    TORCH_CHECK(!g_held.erase(b), "neuron: ", name,
                " kept a tensor it allocated past its call; its results may be wrong. Please report this; "
                "TORCHNEURON_LAUNCH_BLOCKING=1 runs every op at its launch.");
}

}  // namespace torchneuron
