// F.scaled_dot_product_attention on neuron: the backend's _fused_sdp_choice picks the fused op CUDA's memory-
// efficient attention uses, `_scaled_dot_product_efficient_attention` (masks, causal, dropout, scale), because
// DTensor has sharding rules for it (tensor/sequence parallel shard the heads) and the compiler and cost model know
// it. The neuron kernels compute it with the CPU's numerics: the CPU flash kernel (forward and backward) wherever
// the CPU's own SDPA would take it, the CPU's math op otherwise, and with attention dropout the math formula with
// the neuron generator's mask (scores computed once for the result and its log-sum-exp); the gradient of the math
// formula. What the fused op cannot express
// (inputs that are not 4-D, unsupported dtypes, GQA's unequal head counts, or sdpa_kernel excluding it) takes the
// math decomposition, counted as aten::_scaled_dot_product_attention_math in get_executed_ops().
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <torch/library.h>

#include <cmath>
#include <deque>
#include <mutex>

#include "runtime.h"

namespace torchneuron {
namespace {

using sdp::SDPBackend;

int64_t choose_sdp(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                   double p, bool causal, std::optional<double> scale, bool enable_gqa) {
  auto fused_dtype = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
  };
  bool ok = q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && !q.is_nested() && !k.is_nested() && !v.is_nested() &&
            fused_dtype(q) && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type();
  if (ok) {
    int64_t hq = q.sym_size(1).guard_int(__FILE__, __LINE__), hk = k.sym_size(1).guard_int(__FILE__, __LINE__);
    // GQA (fewer key/value heads) takes math: the fused op's meta kernel, which DTensor's sharding propagation
    // and torch.compile's fake tensors use, gives the key/value gradients the query's head count.
    ok = hq == hk && k.sym_size(1) == v.sym_size(1);
  }
  if (ok && at::globalContext().userEnabledMemEfficientSDP())  // torch.nn.attention.sdpa_kernel may exclude it
    return static_cast<int64_t>(SDPBackend::efficient_attention);
  note_executed("aten::_scaled_dot_product_attention_math");
  return static_cast<int64_t>(SDPBackend::math);
}

// Would the CPU's SDPA run these (host) inputs through its flash kernel? Dropout never: the mask must come from
// the neuron generator, which only the math op accepts.
bool cpu_takes_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& bias, double p, bool causal, std::optional<double> scale) {
  if (p > 0) return false;
  return at::_fused_sdp_choice(q, k, v, bias, p, causal, scale) == static_cast<int64_t>(SDPBackend::flash_attention);
}

// Attention dropout's [B, H, L, S] multiplier from counters (offset + i), as every neuron random op draws: 1 / (1 - p)
// where the element is kept, else 0.
at::Tensor keep_scale(uint64_t seed, uint64_t offset, at::IntArrayRef sizes, double p) {
  auto m = at::empty(sizes, at::TensorOptions().dtype(at::kFloat));
  float* d = m.data_ptr<float>();
  const BelowP keep(1.0 - p);
  const float kept = static_cast<float>(1.0 / (1.0 - p));
  for_each_philox(seed, offset, m.numel(),
                  [&](int64_t i, uint32_t w0, uint32_t w1, uint32_t, uint32_t) { d[i] = keep(w0, w1) ? kept : 0.0f; });
  return m;
}

// Attention dropout's multipliers, from a forward to its backward, which would draw the same counters again (the
// multiplier is a function of seed, offset, shape and p alone): this only saves the backward that work. Bounded (the
// oldest go first); a miss (evicted, or taken by an earlier backward of the same graph) draws it again, same values.
class KeepMemo {
 public:
  void put(uint64_t seed, uint64_t offset, double p, const at::Tensor& keep) {
    const size_t bytes = keep.nbytes();
    if (bytes > kMaxBytes) return;
    std::lock_guard<std::mutex> g(mu_);
    entries_.push_back({seed, offset, p, keep});
    for (bytes_ += bytes; bytes_ > kMaxBytes; entries_.pop_front()) bytes_ -= entries_.front().keep.nbytes();
  }
  at::Tensor take(uint64_t seed, uint64_t offset, double p, at::IntArrayRef sizes) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->seed != seed || it->offset != offset || it->p != p || it->keep.sizes() != sizes) continue;
      at::Tensor keep = std::move(it->keep);
      bytes_ -= keep.nbytes();
      entries_.erase(it);
      return keep;
    }
    return {};
  }

 private:
  static constexpr size_t kMaxBytes = size_t{64} << 20;
  struct Entry {
    uint64_t seed, offset;
    double p;
    at::Tensor keep;
  };
  std::mutex mu_;
  std::deque<Entry> entries_;
  size_t bytes_ = 0;
};
KeepMemo& keep_memo() {
  static auto* memo = new KeepMemo;  // leaked: stream workers may use it during static destruction
  return *memo;
}

double scale_of(const at::Tensor& q, std::optional<double> scale) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// Attention scores in float: scale * q k^T + bias, causal positions (top-left aligned, as the CPU) at -inf.
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& bias, bool causal,
                  double scale) {
  auto s = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-2, -1)).mul_(scale);
  if (bias) s.add_(bias->to(at::kFloat));
  if (causal) s.masked_fill_(at::ones({q.size(2), k.size(2)}, s.options().dtype(at::kBool)).triu_(1), -INFINITY);
  return s;
}

// A device tensor of `sizes` (B, H, L, E) in the fused op's layout, (B, L, H, E) transposed, which its meta kernel
// promises.
at::Tensor fused_layout_like(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::empty({sizes[0], sizes[2], sizes[1], sizes[3]}, options).transpose(1, 2);
}

at::Tensor scalar_long(uint64_t v) { return at::scalar_tensor(static_cast<int64_t>(v), at::kLong); }

// Both kernels are queued on the current stream like any device kernel (the host runs ahead past attention): the
// results are allocated at the launch in the fused op's layouts, and the queued work computes on host aliases,
// then copies its results into theirs.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> efficient_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& bias,
    bool compute_lse, double p, bool causal, std::optional<double> scale) {
  auto dev = check_same_device("aten::_scaled_dot_product_efficient_attention",
                               {query, key, value, bias.value_or(at::Tensor())});
  note_executed("aten::_scaled_dot_product_efficient_attention");
  at::AutoDispatchBelowADInplaceOrView below;
  auto q = host_alias(query), k = on_host(key), v = on_host(value);
  auto b = on_host(bias);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  // What the kernel would fail on, raised at the launch (as CUDA's checks are), not at the next sync point.
  TORCH_CHECK(k.size(0) == B && v.size(0) == B,
              "scaled_dot_product_attention: expected query, key and value to "
              "have the same batch size, got ",
              q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(v.size(2) == S,
              "scaled_dot_product_attention: expected key and value to have the same sequence "
              "length, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(3) == q.size(3),
              "scaled_dot_product_attention: expected query and key to have the same "
              "embedding dimension, got ",
              q.sizes(), " and ", k.sizes());
  if (b) at::infer_size(b->sizes(), {B, H, L, S});  // the mask broadcasts to the scores' shape (or raises)
  auto out = fused_layout_like({B, H, L, v.size(3)}, query.options());
  auto lse = at::empty({B, H, compute_lse ? (L + 31) / 32 * 32 : 0}, query.options().dtype(at::kFloat));
  const bool flash = cpu_takes_flash(q, k, v, b, p, causal, scale);
  PhiloxSlice draw{0, 0};
  if (!flash && p > 0) draw = reserve_philox(std::nullopt, dev, B * H * L * S);  // in launch order
  auto kernel = [q, k, v, b, o = host_alias(out), l = host_alias(lse), flash, compute_lse, p, causal, scale, draw] {
    const int64_t L = q.size(2);
    l.zero_();
    if (flash) {
      auto [res, lse_res] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, p, causal, b, scale);
      o.copy_(res);
      if (compute_lse) l.narrow(2, 0, L).copy_(lse_res);
      return;
    }
    if (p == 0) {  // the CPU's math op, for its numerics
      o.copy_(std::get<0>(at::_scaled_dot_product_attention_math(q, k, v, b, p, causal, std::nullopt, scale)));
      if (compute_lse) l.narrow(2, 0, L).copy_(scores(q, k, b, causal, scale_of(q, scale)).logsumexp(-1));
      return;
    }
    // Dropout (no CPU result to match: the masks are the neuron generator's): the math formula the backward
    // differentiates, with the scores computed once for both the result and the log-sum-exp.
    auto S = scores(q, k, b, causal, scale_of(q, scale));
    if (compute_lse) l.narrow(2, 0, L).copy_(S.logsumexp(-1));
    auto keep = keep_scale(draw.seed, draw.offset, S.sizes(), p);
    if (compute_lse) keep_memo().put(draw.seed, draw.offset, p, keep);  // a backward will follow
    auto P = at::softmax(S, -1).mul_(keep);
    o.copy_(at::matmul(P, v.to(at::kFloat)));
  };
  launch(dev, "aten::_scaled_dot_product_efficient_attention", B * H * L * S,
         access({query, key, value, bias.value_or(at::Tensor())}, {out, lse}), std::move(kernel));
  return {out, lse, scalar_long(draw.seed), scalar_long(draw.offset)};
}

// The gradient of the math formula: P = softmax(S), O = (P * keep / (1 - p)) V.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> math_backward(const at::Tensor& go, const at::Tensor& q,
                                                                         const at::Tensor& k, const at::Tensor& v,
                                                                         const std::optional<at::Tensor>& b, double p,
                                                                         bool causal, double scale, uint64_t seed,
                                                                         uint64_t offset) {
  auto P = at::softmax(scores(q, k, b, causal, scale), -1);
  at::Tensor drop;
  if (p > 0) {
    drop = keep_memo().take(seed, offset, p, P.sizes());
    if (!drop.defined()) drop = keep_scale(seed, offset, P.sizes(), p);
  }
  auto Pd = drop.defined() ? P * drop : P;
  auto g = go.to(at::kFloat), ve = v.to(at::kFloat), ke = k.to(at::kFloat);
  auto gv = at::matmul(Pd.transpose(-2, -1), g);
  auto dP = at::matmul(g, ve.transpose(-2, -1));
  if (drop.defined()) dP.mul_(drop);
  auto dS = P * (dP - (dP * P).sum(-1, true));
  auto gq = at::matmul(dS, ke).mul_(scale);
  auto gk = at::matmul(dS.transpose(-2, -1), q.to(at::kFloat)).mul_(scale);
  at::Tensor gb;
  if (b) gb = at::sum_to(dS, b->sizes()).to(b->scalar_type());
  return {gq.to(q.scalar_type()), gk.to(k.scalar_type()), gv.to(v.scalar_type()), gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> efficient_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& bias, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& philox_seed,
    const at::Tensor& philox_offset, double p, std::array<bool, 4> grad_input_mask, bool causal,
    std::optional<double> scale) {
  auto dev = check_same_device("aten::_scaled_dot_product_efficient_attention_backward",
                               {grad_out, query, key, value, bias, out, lse});
  note_executed("aten::_scaled_dot_product_efficient_attention_backward");
  at::AutoDispatchBelowADInplaceOrView below;
  auto q = host_alias(query), k = on_host(key), v = on_host(value), go = on_host(grad_out);
  auto b = on_host(bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  const bool flash = !grad_input_mask[3] && cpu_takes_flash(q, k, v, b, p, causal, scale);
  // The results the caller asked for, in the fused op's layouts, which its meta kernel promises (compiled graphs
  // are compiled for them): the bias's gradient a view of a buffer whose last dimension is padded to 16.
  auto result = [&](const at::Tensor& like, bool want) {
    return want ? fused_layout_like(like.sizes(), like.options()) : at::Tensor();
  };
  at::Tensor gq = result(query, grad_input_mask[0]), gk = result(key, grad_input_mask[1]),
             gv = result(value, grad_input_mask[2]);
  at::Tensor gb;
  if (grad_input_mask[3] && bias.defined()) {
    auto padded = bias.sizes().vec();
    padded.back() = (padded.back() + 15) / 16 * 16;
    gb = at::empty(padded, bias.options()).narrow(-1, 0, bias.size(-1));
  }
  auto kernel = [q, k, v, go, b, o = on_host(out), l = on_host(lse), seed = on_host(philox_seed),
                 offset = on_host(philox_offset), flash, p, causal, scale,
                 dst = std::array<at::Tensor, 4>{on_host(gq), on_host(gk), on_host(gv), on_host(gb)}] {
    std::array<at::Tensor, 4> res;
    if (flash) {
      auto lse_l = l.narrow(2, 0, q.size(2)).contiguous();
      std::tie(res[0], res[1], res[2]) =
          at::_scaled_dot_product_flash_attention_for_cpu_backward(go, q, k, v, o, lse_l, p, causal, b, scale);
    } else {
      std::tie(res[0], res[1], res[2], res[3]) =
          math_backward(go, q, k, v, b, p, causal, scale_of(q, scale), static_cast<uint64_t>(seed.item<int64_t>()),
                        static_cast<uint64_t>(offset.item<int64_t>()));
    }
    for (size_t i = 0; i < dst.size(); ++i)
      if (dst[i].defined()) dst[i].copy_(res[i]);
  };
  launch(dev, "aten::_scaled_dot_product_efficient_attention_backward", q.size(0) * q.size(1) * q.size(2) * k.size(2),
         access({grad_out, query, key, value, bias, out, lse}, {gq, gk, gv, gb}), std::move(kernel));
  return {gq, gk, gv, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_scaled_dot_product_efficient_attention", efficient_attention);
  m.impl("_scaled_dot_product_efficient_attention_backward", efficient_attention_backward);
}

}  // namespace torchneuron

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torchneuron::choose_sdp)
}
