// PrivateUse1 hooks: what generic PyTorch code asks of an accelerator (availability, generators, pinned host
// memory, the device of a pointer, storage resizing).
//
// Generators: each neuron device has its own mt19937 engine, the CPU's engine, so a model seeded identically
// draws identical numbers on `neuron` and on `cpu` (dropout masks, initialisation). A neuron generator wraps a CPU
// generator because the ATen CPU kernels the device runs on accept only CPU generators.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_set>

#include "runtime.h"

namespace torchneuron {
namespace {

struct NeuronGenerator final : public c10::GeneratorImpl {
  explicit NeuronGenerator(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(kNeuron, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        host(at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val)) {}

  void set_current_seed(uint64_t seed) override { host.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { host.set_offset(offset); }
  uint64_t get_offset() const override { return host.get_offset(); }
  uint64_t current_seed() const override { return host.current_seed(); }
  uint64_t seed() override { return host.seed(); }
  void set_state(const c10::TensorImpl& state) override { host.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override { return host.unsafeGetGeneratorImpl()->get_state(); }
  NeuronGenerator* clone_impl() const override {
    auto* g = new NeuronGenerator(device().index());
    g->host = host.clone();
    return g;
  }
  static c10::DeviceType device_type() { return kNeuron; }

  at::Generator host;
};

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
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    c10::DeviceGuard guard(impl->device());
    c10::DataPtr fresh = neuron_allocator()->allocate(newsize);
    size_t keep = std::min(newsize, impl->nbytes());
    if (keep) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
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

at::Generator host_generator_of(const at::Generator& gen) {
  TORCH_CHECK(gen.device().type() == kNeuron, "expected a neuron generator, got one for ", gen.device());
  return static_cast<NeuronGenerator*>(gen.unsafeGetGeneratorImpl())->host;
}

void register_hooks() {
  static NeuronHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
}

}  // namespace torchneuron
