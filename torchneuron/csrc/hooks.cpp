// PrivateUse1 hooks: what generic PyTorch code asks of an accelerator (availability, generators, pinned host
// memory, the device of a pointer, storage resizing).
//
// Generators: counter-based (Philox4x32-10) with CUDA's state layout, 16 bytes [seed: uint64, offset: uint64].
// Element i of a random op draws from counter (offset + i) alone, so a value depends only on (seed, position):
// this is what DTensor's parallel RNG, torch.utils.checkpoint and compiled RNG rely on (docs/device.md, RNG).
// The price: neuron no longer draws the CPU's (mt19937) numbers for the same seed, as CUDA does not.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_set>

#include "runtime.h"

namespace torchneuron {
namespace {

struct NeuronGenerator final : public c10::GeneratorImpl {
  explicit NeuronGenerator(c10::DeviceIndex index, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(c10::Device(kNeuron, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        seed_(seed) {}

  void set_current_seed(uint64_t seed) override { seed_ = seed, offset_ = 0; }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    set_current_seed(c10::detail::getNonDeterministicRandom());
    return seed_;
  }
  // CUDA's layout, which DTensor's _PhiloxState and checkpointing code read and write.
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.dtype() == caffe2::TypeMeta::Make<uint8_t>() && state.numel() == 16,
                "RNG state must be a torch.ByteTensor of 16 bytes [seed: uint64, offset: uint64] (the neuron "
                "generator's state, as CUDA's), got ",
                state.numel(), " elements of ", state.dtype());
    const auto* bytes = static_cast<const uint8_t*>(state.data());
    std::memcpy(&seed_, bytes, 8);
    std::memcpy(&offset_, bytes + 8, 8);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto t = at::empty({16}, at::TensorOptions().dtype(at::kByte));
    auto* bytes = t.data_ptr<uint8_t>();
    std::memcpy(bytes, &seed_, 8);
    std::memcpy(bytes + 8, &offset_, 8);
    return t.getIntrusivePtr();
  }
  NeuronGenerator* clone_impl() const override {
    auto* g = new NeuronGenerator(device().index(), seed_);
    g->offset_ = offset_;
    return g;
  }
  static c10::DeviceType device_type() { return kNeuron; }

  uint64_t seed_, offset_ = 0;
};

NeuronGenerator* check_neuron_generator(const at::Generator& gen) {
  TORCH_CHECK(gen.defined() && gen.device().type() == kNeuron,
              "Expected a 'neuron' device type for generator but "
              "found '",
              gen.defined() ? gen.device().type() : c10::DeviceType::CPU, "'");
  return static_cast<NeuronGenerator*>(gen.unsafeGetGeneratorImpl());
}

at::Generator make_generator(c10::DeviceIndex index) {
  c10::DeviceIndex dev = index < 0 ? current_device() : index;
  check_device_index(dev);
  return at::make_generator<NeuronGenerator>(dev);
}

// Pinned (page-locked on real hardware) host memory: plain aligned host memory that remembers it is pinned.
class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? std::aligned_alloc(64, (n + 63) / 64 * 64) : nullptr;
    TORCH_CHECK_WITH(OutOfMemoryError, !n || p, "could not allocate ", n, " bytes of pinned host memory");
    if (p) {
      std::lock_guard<std::mutex> g(mu);
      ptrs.insert(p);
    }
    return {p, p, &release, c10::Device(c10::kCPU)};
  }
  static void release(void* p) {
    if (!p) return;
    {
      std::lock_guard<std::mutex> g(instance().mu);
      instance().ptrs.erase(p);
    }
    std::free(p);
  }
  bool is_pinned(const void* p) {
    std::lock_guard<std::mutex> g(mu);
    return ptrs.count(const_cast<void*>(p)) > 0;
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dst, const void* src, std::size_t count) const override { std::memcpy(dst, src, count); }
  static PinnedAllocator& instance() {
    static PinnedAllocator a;
    return a;
  }

 private:
  std::mutex mu;
  std::unordered_set<void*> ptrs;
};

struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex index) const override { return index >= 0 && index < device_count(); }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex d) const override { set_current_device(d); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = current_device();
    set_current_device(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override { return default_generator(index); }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override { return make_generator(index); }
  at::Device getDeviceFromPtr(void* data) const override {
    auto d = device_of_pointer(data);
    TORCH_CHECK(d >= 0, "pointer ", data, " is not in neuron device memory");
    return {kNeuron, d};
  }
  bool isPinnedPtr(const void* data) const override { return PinnedAllocator::instance().is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &PinnedAllocator::instance(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_device_storage(*storage.unsafeGetStorageImpl(), newsize);
  }
};

}  // namespace

const at::Generator& default_generator(c10::DeviceIndex index) {
  static std::vector<at::Generator> gens;
  static std::once_flag once;
  std::call_once(once, [] {
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) gens.push_back(make_generator(i));  // seeded like CUDA's
  });
  c10::DeviceIndex dev = index < 0 ? current_device() : index;
  check_device_index(dev);
  return gens[dev];
}

PhiloxSlice reserve_philox(const std::optional<at::Generator>& gen, c10::DeviceIndex device, uint64_t n) {
  const at::Generator& g = gen.has_value() && gen->defined() ? *gen : default_generator(device);
  auto* impl = check_neuron_generator(g);
  std::lock_guard<std::mutex> lock(impl->mutex_);
  PhiloxSlice slice{impl->seed_, impl->offset_};
  impl->offset_ += (n + 3) / 4 * 4;  // CUDA's offsets are multiples of 4; DTensor's increments are too
  return slice;
}

at::Generator host_generator_of(const at::Generator& gen) {
  auto* impl = check_neuron_generator(gen);
  std::lock_guard<std::mutex> lock(impl->mutex_);
  auto w = philox(impl->seed_, impl->offset_);
  return at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(w[0]) | static_cast<uint64_t>(w[1]) << 32);
}

void advance_generator(const at::Generator& gen, uint64_t n) {
  auto* impl = check_neuron_generator(gen);
  std::lock_guard<std::mutex> lock(impl->mutex_);
  impl->offset_ += (std::max<uint64_t>(n, 1) + 3) / 4 * 4;
}

void register_hooks() {
  static NeuronHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
}

}  // namespace torchneuron
