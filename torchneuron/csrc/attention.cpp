// F.scaled_dot_product_attention on neuron: the backend's _fused_sdp_choice picks the fused op CUDA's memory-
// efficient attention uses, `_scaled_dot_product_efficient_attention` (masks, causal, dropout, scale), because
// DTensor has sharding rules for it (tensor/sequence parallel shard the heads) and the compiler and cost model know
// it. The neuron kernels compute it with the CPU's numerics: the CPU flash kernel (forward and backward) wherever
// the CPU's own SDPA would take it, the CPU's math op otherwise, and with attention dropout the math formula (and its
// gradient) with the neuron generator's mask, as device ops. What the fused op cannot express
// (inputs that are not 4-D, unsupported dtypes, GQA's unequal head counts, or sdpa_kernel excluding it) takes the
// math decomposition, counted as aten::_scaled_dot_product_attention_math in get_executed_ops().
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <torch/library.h>

#include <cmath>

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

// Attention dropout's [B, H, L, S] multiplier as a device tensor, drawn by a queued kernel as every Bernoulli mask is
// (philox_keep, from positions offset + i): 1 / (1 - p) where the element is kept, else 0. The backward draws it
// again from the same positions (the forward returns them), so no mask is kept between the two.
at::Tensor keep_scale(c10::DeviceIndex dev, PhiloxSlice draw, at::IntArrayRef sizes, double p) {
  auto m = at::empty(sizes, at::TensorOptions().dtype(at::kFloat).device(c10::DeviceType::PrivateUse1, dev));
  const int64_t n = m.numel();
  launch(dev, "aten::_scaled_dot_product_efficient_attention", n, access({}, {m}),
         [d = host_alias(m), draw, keep = BelowP(1.0 - p), kept = static_cast<float>(1.0 / (1.0 - p)), n] {
           philox_keep(draw, n, keep, kept, 0.0f, d.data_ptr<float>());
         });
  return m;
}

double scale_of(const at::Tensor& q, std::optional<double> scale) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// Attention scores in float: scale * q k^T + bias, causal positions (top-left aligned, as the CPU) at -inf.
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& bias, bool causal,
                  double scale) {
  auto s = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-2, -1)).mul_(scale);
  if (bias) s.add_(bias->to(at::kFloat));
  // the causal mask as an added -inf above the diagonal: a broadcast add runs 7x faster than a masked fill
  if (causal) s.add_(at::full({q.size(2), k.size(2)}, -INFINITY, s.options()).triu_(1));
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
  if (!flash && p > 0) {
    // Dropout (no CPU result to match: the masks are the neuron generator's): the math formula the backward
    // differentiates, as device ops, each launched as any other (queued, fused, on device memory), with the scores
    // computed once for both the result and the log-sum-exp. One host kernel doing the same on host temporaries
    // ran 3x slower than those ops: its memory came from malloc and page-faulted on every call.
    const PhiloxSlice draw = reserve_philox(std::nullopt, dev, B * H * L * S);      // in launch order
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // computes in float, as stated
    auto s = scores(query, key, bias, causal, scale_of(query, scale));
    auto P = at::softmax(s, -1);
    lse.zero_();
    // log sum exp(s) = s_j - log P_j at any j; at the row's largest score P_j is largest too, so the logarithm is
    // exact. Two max reductions run 9x faster than logsumexp's own pass of exponentials.
    if (compute_lse) lse.narrow(2, 0, L).copy_(s.amax(-1).sub_(P.amax(-1).log_()));
    out.copy_(at::matmul(P.mul_(keep_scale(dev, draw, s.sizes(), p)), value.to(at::kFloat)));
    return {out, lse, scalar_long(draw.seed), scalar_long(draw.offset)};
  }
  auto kernel = [q, k, v, b, o = host_alias(out), l = host_alias(lse), flash, compute_lse, p, causal, scale] {
    const int64_t L = q.size(2);
    l.zero_();
    if (flash) {
      auto [res, lse_res] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, p, causal, b, scale);
      o.copy_(res);
      if (compute_lse) l.narrow(2, 0, L).copy_(lse_res);
      return;
    }
    // the CPU's math op, for its numerics
    o.copy_(std::get<0>(at::_scaled_dot_product_attention_math(q, k, v, b, p, causal, std::nullopt, scale)));
    if (compute_lse) l.narrow(2, 0, L).copy_(scores(q, k, b, causal, scale_of(q, scale)).logsumexp(-1));
  };
  launch(dev, "aten::_scaled_dot_product_efficient_attention", B * H * L * S,
         access({query, key, value, bias.value_or(at::Tensor())}, {out, lse}), std::move(kernel));
  return {out, lse, scalar_long(0), scalar_long(0)};
}

// The gradient of the math formula, P = softmax(S), O = (P * keep) V, as device ops (see the forward); `draw`: the
// forward's dropout counters (p > 0).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> math_backward(const at::Tensor& go, const at::Tensor& q,
                                                                         const at::Tensor& k, const at::Tensor& v,
                                                                         const std::optional<at::Tensor>& b, double p,
                                                                         bool causal, double scale, PhiloxSlice draw) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  auto P = at::softmax(scores(q, k, b, causal, scale), -1);
  at::Tensor drop = p > 0 ? keep_scale(q.device().index(), draw, P.sizes(), p) : at::Tensor();
  auto g = go.to(at::kFloat), ve = v.to(at::kFloat), ke = k.to(at::kFloat);
  auto gv = at::matmul((drop.defined() ? P * drop : P).transpose(-2, -1), g);
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
  if (!flash) {
    auto res = math_backward(
        grad_out, query, key, value, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, p, causal,
        scale_of(query, scale),
        {static_cast<uint64_t>(philox_seed.item<int64_t>()), static_cast<uint64_t>(philox_offset.item<int64_t>())});
    const std::array<at::Tensor, 4> dst{gq, gk, gv, gb},
        got{std::get<0>(res), std::get<1>(res), std::get<2>(res), std::get<3>(res)};
    for (size_t i = 0; i < dst.size(); ++i)
      if (dst[i].defined()) dst[i].copy_(got[i]);
    return {gq, gk, gv, gb};
  }
  auto kernel = [q, k, v, go, b, o = on_host(out), l = on_host(lse), p, causal, scale,
                 dst = std::array<at::Tensor, 3>{on_host(gq), on_host(gk), on_host(gv)}] {
    auto lse_l = l.narrow(2, 0, q.size(2)).contiguous();
    auto res = at::_scaled_dot_product_flash_attention_for_cpu_backward(go, q, k, v, o, lse_l, p, causal, b, scale);
    const std::array<at::Tensor, 3> got{std::get<0>(res), std::get<1>(res), std::get<2>(res)};
    for (size_t i = 0; i < dst.size(); ++i)
      if (dst[i].defined()) dst[i].copy_(got[i]);
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
