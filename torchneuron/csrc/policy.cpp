// The device policies, set by name from Python (runtime/policy.py): the dtype policy (`trainium` applies
// Trainium's dtype rules, `host` keeps full precision) and the fallback policy (what a host fallback does). Also
// the dtype rules themselves, and their application to data entering the device outside an op (host->device
// copies, collective results). docs/device.md: "Trainium rules", "Fallback policy".
#include <limits>
#include <string>

#include "runtime.h"

namespace torchneuron {
namespace {

// In enum order (runtime.h); the configuration accepts exactly these names (tests/test_fallback_policy.py).
constexpr const char* kDtypePolicies[] = {"trainium", "host"};
constexpr const char* kFallbackPolicies[] = {"warn", "silent", "error"};

std::atomic<DtypePolicy> g_dtype_policy{DtypePolicy::trainium};
std::atomic<FallbackPolicy> g_fallback_policy{FallbackPolicy::warn};
thread_local bool t_internal_math = false;  // see set_internal_math

template <class Policy, size_t N>
Policy parse_policy(const char* what, const char* const (&names)[N], const std::string& name) {
  size_t i = 0;
  while (i < N && name != names[i]) ++i;
  std::string valid;
  for (const char* n : names) valid += (valid.empty() ? "'" : ", '") + std::string(n) + "'";
  TORCH_CHECK_VALUE(i < N, "neuron: unknown ", what, " policy '", name, "'; valid values: ", valid);
  return static_cast<Policy>(i);
}

}  // namespace

void set_policies(const std::string& dtype, const std::string& fallback) {
  auto d = parse_policy<DtypePolicy>("dtype", kDtypePolicies, dtype);
  auto f = parse_policy<FallbackPolicy>("fallback", kFallbackPolicies, fallback);
  g_dtype_policy = d;
  g_fallback_policy = f;
}

FallbackPolicy fallback_policy() { return g_fallback_policy.load(std::memory_order_relaxed); }

bool trainium_rules() {
  return g_dtype_policy.load(std::memory_order_relaxed) == DtypePolicy::trainium && !t_internal_math;
}

bool set_internal_math(bool on) {
  bool was = t_internal_math;
  t_internal_math = on;
  return was;
}

bool is_fp64(const at::Tensor& t) {
  return t.defined() && (t.scalar_type() == at::kDouble || t.scalar_type() == at::kComplexDouble);
}

// Trainium rule for float64: values carry float32 precision.
void round_to_fp32(const at::Tensor& host) {
  if (is_fp64(host) && host.numel() > 0)
    host.copy_(host.to(host.scalar_type() == at::kDouble ? at::kFloat : at::kComplexFloat));
}

Int64Range int64_range(const at::Tensor& host) {
  if (host.scalar_type() != at::kLong || host.numel() == 0) return {};
  auto [lo, hi] = at::aminmax(host);
  Int64Range r{lo.item<int64_t>(), hi.item<int64_t>()};
  r.outside = r.lo < std::numeric_limits<int32_t>::min() || r.hi > std::numeric_limits<int32_t>::max();
  return r;
}

void note_host_to_device(const at::Tensor& host) {
  if (!trainium_rules()) return;
  const bool fp64 = is_fp64(host);
  if (!fp64 && host.scalar_type() != at::kLong) return;
  if (fp64) {
    round_to_fp32(host);
    note_fp64(copy_in_entry(), Fp64Event::copied);
  }
  note_int64(copy_in_entry(), int64_range(host));
}

void note_device_result(const std::string& name, const at::Tensor& t) {
  if (!trainium_rules() || !t.defined() || t.device().type() != kNeuron || !is_fp64(t) || t.numel() == 0) return;
  round_to_fp32(host_alias(t));
  note_fp64(outside_entry(name), Fp64Event::produced);
}

}  // namespace torchneuron
