// Counter-based random kernels: element i (in the tensor's logical row-major order) of a random op draws only from
// Philox counter (offset + i) of the generator (hooks.cpp), or for a Bernoulli mask from one word of a counter of its
// own stream (philox_keep), so a value depends on (seed, offset + position) alone.
// A DTensor shard drawn at DTensor's shard offset therefore holds exactly the values of the same slice of the
// unsharded tensor. Each kernel makes the values in float64 on the host and writes them with a cast.
// Every argument check is the CPU's own (check_like_cpu). Random ops not listed here (multinomial, randperm, poisson,
// normal with tensor arguments, ...) run as host fallbacks with a CPU generator seeded from the next counter
// (fallback.cpp, host_generator_of).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/native/DistributionTemplates.h>
#include <c10/util/MathConstants.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>

#include "runtime.h"

namespace torchneuron {
namespace {

#if defined(__x86_64__)
#include <immintrin.h>
// Eight counters per step: the multiplications' high and low words from two 32x32->64 products per 64-bit lane.
__attribute__((target("avx2"))) inline void mulhilo(__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
  __m256i even = _mm256_mul_epu32(a, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}
__attribute__((target("avx2"))) inline __m256i less_unsigned(__m256i a, __m256i b) {
  const __m256i sign = _mm256_set1_epi32(INT32_MIN);
  return _mm256_cmpgt_epi32(_mm256_xor_si256(b, sign), _mm256_xor_si256(a, sign));
}
__attribute__((target("avx2"))) void philox_chunk_avx2(uint64_t seed, uint64_t first, int n, uint32_t stream,
                                                       uint32_t (&words)[4][kPhiloxChunk]) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53)),
                m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int base = 0; base < n; base += 8) {
    const uint64_t ctr = first + static_cast<uint64_t>(base);
    const __m256i start = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(ctr)));
    __m256i c0 = _mm256_add_epi32(start, lane);  // a lane whose low word wrapped carries into its high word
    __m256i c1 = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(ctr >> 32))),
                                  less_unsigned(c0, start));
    __m256i c2 = _mm256_set1_epi32(static_cast<int>(stream)), c3 = _mm256_setzero_si256();
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      __m256i h0, l0, h1, l1;
      mulhilo(c0, m0, h0, l0);
      mulhilo(c2, m1, h1, l1);
      c0 = _mm256_xor_si256(_mm256_xor_si256(h1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
      c2 = _mm256_xor_si256(_mm256_xor_si256(h0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
      c1 = l1, c3 = l0;
      k0 += 0x9E3779B9, k1 += 0xBB67AE85;
    }
    if (n - base >= 8) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[0] + base), c0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[1] + base), c1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[2] + base), c2);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[3] + base), c3);
    } else {
      alignas(32) uint32_t t[4][8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(t[0]), c0);
      _mm256_store_si256(reinterpret_cast<__m256i*>(t[1]), c1);
      _mm256_store_si256(reinterpret_cast<__m256i*>(t[2]), c2);
      _mm256_store_si256(reinterpret_cast<__m256i*>(t[3]), c3);
      for (int k = 0; k < 4; ++k)
        for (int j = 0; j < n - base; ++j) words[k][base + j] = t[k][j];
    }
  }
}
// The same with sixteen counters per step, where the CPU has AVX-512 (the same words: tests compare with philox()).
__attribute__((target("avx512f"))) inline void mulhilo(__m512i a, __m512i m, __m512i& hi, __m512i& lo) {
  __m512i even = _mm512_mul_epu32(a, m), odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}
// Sixteen counters from `ctr` on (in `stream`): their four words after the ten rounds.
__attribute__((target("avx512f"))) inline void philox16(uint64_t seed, uint64_t ctr, uint32_t stream, __m512i (&c)[4]) {
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53)),
                m1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i start = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(ctr)));
  c[0] = _mm512_add_epi32(start, lane);  // a lane whose low word wrapped carries into its high word
  const __m512i high = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(ctr >> 32)));
  c[1] = _mm512_mask_add_epi32(high, _mm512_cmplt_epu32_mask(c[0], start), high, _mm512_set1_epi32(1));
  c[2] = _mm512_set1_epi32(static_cast<int>(stream)), c[3] = _mm512_setzero_si512();
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    __m512i h0, l0, h1, l1;
    mulhilo(c[0], m0, h0, l0);
    mulhilo(c[2], m1, h1, l1);
    c[0] = _mm512_xor_si512(_mm512_xor_si512(h1, c[1]), _mm512_set1_epi32(static_cast<int>(k0)));
    c[2] = _mm512_xor_si512(_mm512_xor_si512(h0, c[3]), _mm512_set1_epi32(static_cast<int>(k1)));
    c[1] = l1, c[3] = l0;
    k0 += 0x9E3779B9, k1 += 0xBB67AE85;
  }
}
__attribute__((target("avx512f"))) inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}
__attribute__((target("avx512f"))) void philox_chunk_avx512(uint64_t seed, uint64_t first, int n, uint32_t stream,
                                                            uint32_t (&words)[4][kPhiloxChunk]) {
  for (int base = 0; base < n; base += 16) {
    __m512i c[4];
    philox16(seed, first + static_cast<uint64_t>(base), stream, c);
    for (int k = 0; k < 4; ++k) _mm512_mask_storeu_epi32(words[k] + base, first_lanes(n - base), c[k]);
  }
}
// philox_keep's form where the CPU has AVX-512, for the 64-position blocks [b, e) (block numbers, positions / 64):
// each block is sixteen counters, and word k of them the keep test of its sixteen elements from 16 k on. A float mask
// is stored as a vector; any other dtype's from the sixteen keep bits.
template <class T>
__attribute__((target("avx512f"))) void philox_keep_avx512(PhiloxSlice s, int64_t n, uint64_t b, uint64_t e,
                                                           const BelowP& keep, T kept, T dropped, T* out) {
  const __m512i bound = _mm512_set1_epi32(static_cast<int>(keep.bound));
  for (; b < e; ++b) {
    __m512i c[4];
    philox16(s.seed, b * 16, kMaskStream, c);
    for (int k = 0; k < 4; ++k) {
      const auto at = static_cast<int64_t>(b * 64 + 16 * static_cast<uint64_t>(k) - s.offset);  // element of lane 0
      const __mmask16 below = keep.all ? 0xFFFF : _mm512_cmplt_epu32_mask(c[k], bound);
      const int j0 = static_cast<int>(std::max<int64_t>(0, -at)), j1 = static_cast<int>(std::min<int64_t>(16, n - at));
      if (j0 >= j1) continue;
      if constexpr (std::is_same_v<T, float>) {
        const auto lanes = static_cast<__mmask16>(((1u << j1) - 1) & ~((1u << j0) - 1));
        _mm512_mask_storeu_ps(out + at, lanes,
                              _mm512_mask_blend_ps(below, _mm512_set1_ps(dropped), _mm512_set1_ps(kept)));
      } else {
        for (int j = j0; j < j1; ++j) out[at + j] = below >> j & 1 ? kept : dropped;
      }
    }
  }
}
// The vector forms in use: the CPU's, capped as ATen caps its own kernels by ATEN_CPU_CAPABILITY ("default": none,
// "avx2": no AVX-512), so every form can be run, and compared, on one machine.
bool capability_allows(const char* isa) {
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  if (cap == nullptr || *cap == 0) return true;
  const std::string c = cap;
  return c != "default" && (c != "avx2" || std::string(isa) == "avx2");
}
const bool kHaveAvx2 = __builtin_cpu_supports("avx2") && capability_allows("avx2"),
           kHaveAvx512 = __builtin_cpu_supports("avx512f") && capability_allows("avx512");
#else
constexpr bool kHaveAvx2 = false, kHaveAvx512 = false;
#endif

struct Draws {
  at::Tensor u1, u2;  // float64, shaped like the target; u2 only when asked for (from the counter's other words)
  at::Tensor bits;    // int64 raw 64-bit words, only when asked for
};

enum class Want { one, two, bits };

Draws draw(PhiloxSlice s, at::IntArrayRef sizes, Want want) {
  Draws d;
  auto opts = at::TensorOptions().dtype(want == Want::bits ? at::kLong : at::kDouble);
  (want == Want::bits ? d.bits : d.u1) = at::empty(sizes, opts);
  if (want == Want::two) d.u2 = at::empty(sizes, opts);
  const int64_t n = c10::multiply_integers(sizes);
  double* a = want == Want::bits ? nullptr : d.u1.data_ptr<double>();
  double* b = want == Want::two ? d.u2.data_ptr<double>() : nullptr;
  int64_t* w64 = want == Want::bits ? d.bits.data_ptr<int64_t>() : nullptr;
  parallel_philox(s, n, [&](int64_t i, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
    if (w64) w64[i] = static_cast<int64_t>(static_cast<uint64_t>(w1) << 32 | w0);
    if (a) a[i] = philox_unit(w0, w1);
    if (b) b[i] = philox_unit(w2, w3);
  });
  return d;
}

// The tensor the kernel fills: complex tensors are filled as their real view (as ATen does).
at::Tensor target(const at::Tensor& self) { return self.is_complex() ? at::view_as_real(self) : self; }

// The counters are reserved now, in program order (element i of `over` draws counter offset + i); the values are
// made and written into `self` on its stream: values(draws) -> the tensor to write.
template <class F>
at::Tensor& fill_random(at::Tensor& self, const at::Tensor& over, const std::optional<at::Generator>& gen, Want want,
                        const char* name, F values) {
  if (over.numel() == 0) return self;  // as the CPU: nothing drawn, nothing launched
  const c10::DeviceIndex dev = self.device().index();
  auto slice = reserve_philox(gen, dev, static_cast<uint64_t>(over.numel()));
  note_executed(name);
  at::Tensor dst = host_alias(target(self));
  launch(dev, name, over.numel(), access({}, {self}), [dst, slice, want, sizes = over.sizes().vec(), values]() mutable {
    dst.copy_(values(draw(slice, sizes, want)));
  });
  return self;
}

at::Tensor normal_values(Draws d) {  // Box-Muller on the element's own two uniforms
  return d.u1.log_().mul_(-2.0).sqrt_().mul_(d.u2.mul_(2.0 * c10::pi<double>).cos_());
}

// The argument checks of a random op are the CPU's own, not a copy of them: the op first runs on a CPU tensor of
// the same dtype with min(numel, 1) elements and the same arguments, drawing from a private generator. So the
// call raises what the CPU raises, with its type and message (ranges against the dtype, from < to, a dtype the
// distribution does not support), gives its warnings (random_'s precision warning), and lets an empty tensor pass
// what the CPU lets it pass. Then, as the CPU's TensorIterator, a tensor whose elements overlap is refused.
template <class F>
void check_like_cpu(const at::Tensor& self, F&& op) {
  static thread_local at::Generator probe_gen = at::make_generator<at::CPUGeneratorImpl>(0);
  at::Tensor probe = at::empty({std::min<int64_t>(self.numel(), 1)}, self.options().device(at::kCPU));
  op(probe, probe_gen);
  if (self.numel() > 0) at::assert_no_internal_overlap(self);
}

at::Tensor& uniform_(at::Tensor& self, double from, double to, std::optional<at::Generator> gen) {
  check_like_cpu(self, [&](at::Tensor& p, const at::Generator& g) { p.uniform_(from, to, g); });
  auto st = target(self).scalar_type();
  return fill_random(self, target(self), gen, Want::one, "aten::uniform_", [=](Draws d) {
    auto v = d.u1.mul_(to - from).add_(from).to(st);
    return v.masked_fill_(v.ge(to).logical_and_(v.gt(from)), from);  // rounding to the dtype can reach `to`
  });
}

at::Tensor& normal_(at::Tensor& self, double mean, double std, std::optional<at::Generator> gen) {
  check_like_cpu(self, [&](at::Tensor& p, const at::Generator& g) { p.normal_(mean, std, g); });
  if (self.is_complex()) std /= std::sqrt(2.0);
  return fill_random(self, target(self), gen, Want::two, "aten::normal_",
                     [=](Draws d) { return normal_values(d).mul_(std).add_(mean); });
}

at::Tensor& log_normal_(at::Tensor& self, double mean, double std, std::optional<at::Generator> gen) {
  check_like_cpu(self, [&](at::Tensor& p, const at::Generator& g) { p.log_normal_(mean, std, g); });
  return fill_random(self, self, gen, Want::two, "aten::log_normal_",
                     [=](Draws d) { return normal_values(d).mul_(std).add_(mean).exp_(); });
}

at::Tensor& exponential_(at::Tensor& self, double lambd, std::optional<at::Generator> gen) {
  check_like_cpu(self, [&](at::Tensor& p, const at::Generator& g) { p.exponential_(lambd, g); });
  return fill_random(self, self, gen, Want::one, "aten::exponential_",
                     [=](Draws d) { return d.u1.log_().div_(-lambd); });
}

at::Tensor& cauchy_(at::Tensor& self, double median, double sigma, std::optional<at::Generator> gen) {
  check_like_cpu(self, [&](at::Tensor& p, const at::Generator& g) { p.cauchy_(median, sigma, g); });
  return fill_random(self, self, gen, Want::one, "aten::cauchy_",
                     [=](Draws d) { return d.u1.sub_(0.5).mul_(c10::pi<double>).tan_().mul_(sigma).add_(median); });
}

at::Tensor& geometric_(at::Tensor& self, double p, std::optional<at::Generator> gen) {
  check_like_cpu(self, [&](at::Tensor& t, const at::Generator& g) { t.geometric_(p, g); });
  return fill_random(self, self, gen, Want::one, "aten::geometric_",
                     [=](Draws d) { return d.u1.log_().div_(std::log1p(-p)).ceil_(); });
}

at::Tensor& bernoulli_float(at::Tensor& self, double p, std::optional<at::Generator> gen) {
  check_like_cpu(self, [&](at::Tensor& t, const at::Generator& g) { t.bernoulli_(p, g); });
  if (self.numel() == 0) return self;
  if (!self.is_contiguous() || !(at::isFloatingType(self.scalar_type()) || self.scalar_type() == at::kBool)) {
    // the same mask, made contiguous in bool (logical row-major order) and copied in: one draw rule for every layout
    at::Tensor mask = at::empty(self.sizes(), self.options().dtype(at::kBool));
    return self.copy_(bernoulli_float(mask, p, gen));
  }
  const c10::DeviceIndex dev = self.device().index();
  const int64_t n = self.numel();
  auto s = reserve_philox(gen, dev, static_cast<uint64_t>(n));
  note_executed("aten::bernoulli_");
  at::Tensor dst = host_alias(self);
  launch(dev, "aten::bernoulli_", n, access({}, {self}), [dst, s, below = BelowP(p), n]() mutable {
    AT_DISPATCH_FLOATING_TYPES_AND3(at::kBFloat16, at::kHalf, at::kBool, dst.scalar_type(), "bernoulli_", [&] {
      philox_keep(s, n, below, static_cast<scalar_t>(1), static_cast<scalar_t>(0), dst.data_ptr<scalar_t>());
    });
  });
  return self;
}

at::Tensor& bernoulli_tensor(at::Tensor& self, const at::Tensor& p, std::optional<at::Generator> gen) {
  check_like_cpu(self, [&](at::Tensor& t, const at::Generator& g) {
    t.bernoulli_(at::zeros({std::min<int64_t>(p.numel(), 1)}, p.options().device(at::kCPU)), g);
  });
  if (self.numel() == 0) return self;
  (void)at::expand_inplace(self, p);  // the CPU's broadcast check of p against self (metadata only)
  // a device p is read on the stream, in order; a host p now
  at::Tensor probs = p.device().type() == kNeuron ? host_alias(p) : p.clone();
  auto sizes = self.sizes().vec();
  return fill_random(self, self, gen, Want::one, "aten::bernoulli_",
                     [=](Draws d) { return d.u1.lt(probs.to(at::kDouble).expand(sizes)); });
}

at::Tensor bernoulli(const at::Tensor& self, std::optional<at::Generator> gen) {
  auto out = at::empty_like(self, at::MemoryFormat::Contiguous);
  return bernoulli_tensor(out, self, gen);
}

at::Tensor bernoulli_p(const at::Tensor& self, double p, std::optional<at::Generator> gen) {
  auto out = at::empty_like(self, at::MemoryFormat::Contiguous);
  return bernoulli_float(out, p, gen);
}

// The values random_ draws, as the CPU's random_from_to_impl: [from, to), or [from, the dtype's top] without `to`,
// or all 64 bits from the lowest int64 (range 0 stands for 2^64); for a floating dtype the bounds move inwards
// (ATen's update_from/update_to) so that no value reaches `to` once cast. Each element reduces its own 64-bit word.
uint64_t random_range(at::ScalarType st, int64_t& from, std::optional<int64_t> to) {
  if (!to && from == std::numeric_limits<int64_t>::lowest()) return 0;
  int64_t top = 0;  // inclusive
  if (at::isFloatingType(st)) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "random_", [&] {
      from = at::native::templates::update_from<scalar_t>(from);
      constexpr int digits = std::numeric_limits<scalar_t>::digits;
      top = to             ? at::native::templates::update_to<scalar_t>(*to) - 1
            : digits >= 63 ? std::numeric_limits<int64_t>::max()
                           : int64_t{1} << digits;
    });
  } else if (to) {
    top = *to - 1;
  } else {
    AT_DISPATCH_V2(st, "random_", AT_WRAP([&] {
                     if constexpr (std::is_same_v<scalar_t, bool>)
                       top = 1;
                     else
                       top = static_cast<int64_t>(std::numeric_limits<scalar_t>::max());
                   }),
                   AT_EXPAND(AT_INTEGRAL_TYPES_V2), at::kBool);
  }
  return static_cast<uint64_t>(top) - static_cast<uint64_t>(from) + 1;
}

template <class Check>
at::Tensor& random_impl(at::Tensor& self, int64_t from, std::optional<int64_t> to, std::optional<at::Generator> gen,
                        Check check) {
  check_like_cpu(self, check);
  if (self.numel() == 0) return self;
  const uint64_t range = random_range(self.scalar_type(), from, to);
  return fill_random(self, self, gen, Want::bits, "aten::random_", [=](Draws d) {
    if (range != 0) {
      auto* w = d.bits.data_ptr<int64_t>();
      for (int64_t i = 0, n = d.bits.numel(); i < n; ++i)
        w[i] = static_cast<int64_t>(static_cast<uint64_t>(from) + static_cast<uint64_t>(w[i]) % range);
    }
    return d.bits;
  });
}

at::Tensor& random_from_to(at::Tensor& self, int64_t from, std::optional<int64_t> to,
                           std::optional<at::Generator> gen) {
  return random_impl(self, from, to, gen, [&](at::Tensor& p, const at::Generator& g) { p.random_(from, to, g); });
}
at::Tensor& random_to(at::Tensor& self, int64_t to, std::optional<at::Generator> gen) {
  return random_impl(self, 0, to, gen, [&](at::Tensor& p, const at::Generator& g) { p.random_(to, g); });
}
at::Tensor& random_full(at::Tensor& self, std::optional<at::Generator> gen) {  // the CPU's [0, top] of the dtype
  return random_impl(self, 0, std::nullopt, gen, [&](at::Tensor& p, const at::Generator& g) { p.random_(g); });
}

}  // namespace

void philox_chunk(uint64_t seed, uint64_t first, int n, uint32_t (&words)[4][kPhiloxChunk], uint32_t stream) {
#if defined(__x86_64__)
  if (kHaveAvx512) return philox_chunk_avx512(seed, first, n, stream, words);
  if (kHaveAvx2) return philox_chunk_avx2(seed, first, n, stream, words);
#endif
  for (int j = 0; j < n; ++j) {
    auto w = philox(seed, first + static_cast<uint64_t>(j), stream);
    for (int k = 0; k < 4; ++k) words[k][j] = w[k];
  }
}

template <class T>
void philox_keep(PhiloxSlice s, int64_t n, const BelowP& keep, T kept, T dropped, T* out) {
  const uint64_t first = s.offset >> 6, blocks = ((s.offset + static_cast<uint64_t>(n) + 63) >> 6) - first;
#if defined(__x86_64__)
  if (kHaveAvx512)
    return at::parallel_for(0, static_cast<int64_t>(blocks), 32, [&](int64_t lo, int64_t hi) {
      philox_keep_avx512<T>(s, n, first + lo, first + hi, keep, kept, dropped, out);
    });
#endif
  constexpr int kBlocks = kPhiloxChunk / 16;  // 64-position blocks per chunk of counters
  at::parallel_for(0, static_cast<int64_t>(blocks), 32, [&](int64_t lo, int64_t hi) {
    uint32_t w[4][kPhiloxChunk];
    for (int64_t b = lo; b < hi; b += kBlocks) {
      const int m = static_cast<int>(std::min<int64_t>(kBlocks, hi - b));
      const uint64_t block = first + static_cast<uint64_t>(b);
      philox_chunk(s.seed, block * 16, m * 16, w, kMaskStream);
      for (int bb = 0; bb < m; ++bb)
        for (int k = 0; k < 4; ++k) {
          const auto at = static_cast<int64_t>((block + static_cast<uint64_t>(bb)) * 64 + 16 * k - s.offset);
          const int j0 = static_cast<int>(std::max<int64_t>(0, -at));
          const int j1 = static_cast<int>(std::min<int64_t>(16, n - at));
          for (int j = j0; j < j1; ++j) out[at + j] = keep(w[k][16 * bb + j]) ? kept : dropped;
        }
    }
  });
}
template void philox_keep(PhiloxSlice, int64_t, const BelowP&, float, float, float*);
template void philox_keep(PhiloxSlice, int64_t, const BelowP&, double, double, double*);
template void philox_keep(PhiloxSlice, int64_t, const BelowP&, c10::Half, c10::Half, c10::Half*);
template void philox_keep(PhiloxSlice, int64_t, const BelowP&, c10::BFloat16, c10::BFloat16, c10::BFloat16*);
template void philox_keep(PhiloxSlice, int64_t, const BelowP&, bool, bool, bool*);

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("uniform_", uniform_);
  m.impl("normal_", normal_);
  m.impl("log_normal_", log_normal_);
  m.impl("exponential_", exponential_);
  m.impl("cauchy_", cauchy_);
  m.impl("geometric_", geometric_);
  m.impl("bernoulli_.float", bernoulli_float);
  m.impl("bernoulli_.Tensor", bernoulli_tensor);
  m.impl("bernoulli", bernoulli);
  m.impl("bernoulli.p", bernoulli_p);
  m.impl("random_.from", random_from_to);
  m.impl("random_.to", random_to);
  m.impl("random_", random_full);
}

}  // namespace torchneuron
