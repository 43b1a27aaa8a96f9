// The fused RNN cells ATen's RNN.cpp uses for every accelerator input (nn.LSTM, nn.GRU, LSTMCell, GRUCell take
// `_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell` when the input is CUDA, XPU or PrivateUse1; the CPU has no
// kernel for them). On neuron each cell is the CPU's own unfused arithmetic, in the CPU's order (biases added to
// each matmul, then hidden + input gates, then the activations), registered at the autograd level so the ops
// below are recorded like any other: the gradients are the CPU's, double backward works, autocast has already
// cast the inputs, and torch.compile traces plain aten ops. The workspace output has CUDA's layout (activated
// gates; for GRU also hx and the hidden new gate) so the CUDA-style backward kernels below accept it.
//
// nn.LSTM's whole sequence runs as one kernel per layer and direction, as on CUDA (cuDNN) and the CPU (oneDNN):
// `lstm_sequence` below. Per time step the cells would be ~30 launches each, forward and backward.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/lstm_native.h>
#include <ATen/ops/mkldnn_rnn_layer.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>

#include "runtime.h"

namespace torchneuron {
namespace {

at::Tensor with_bias(const at::Tensor& gates, const std::optional<at::Tensor>& bias) {
  return bias && bias->defined() ? gates + *bias : gates;
}

// (hy, cy, workspace [B, 4H]: input, forget, cell, output gates after their activations)
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(const at::Tensor& igates, const at::Tensor& hgates,
                                                               const at::Tensor& cx,
                                                               const std::optional<at::Tensor>& b_ih,
                                                               const std::optional<at::Tensor>& b_hh) {
  TORCH_CHECK(igates.dim() == 2 && igates.sizes() == hgates.sizes() && igates.size(1) == 4 * cx.size(-1),
              "_thnn_fused_lstm_cell: input_gates and hidden_gates must be [batch, 4 * hidden] with hidden = "
              "cx.size(-1), got ",
              igates.sizes(), ", ", hgates.sizes(), " and cx ", cx.sizes());
  auto gates = with_bias(hgates, b_hh) + with_bias(igates, b_ih);
  auto chunks = gates.unsafe_chunk(4, 1);
  auto in = chunks[0].sigmoid(), forget = chunks[1].sigmoid(), cell = chunks[2].tanh(), out = chunks[3].sigmoid();
  auto cy = forget * cx + in * cell;
  auto hy = out * cy.tanh();
  note_executed("aten::_thnn_fused_lstm_cell");
  return {hy, cy, at::cat({in, forget, cell, out}, 1)};
}

// (hy, workspace [B, 5H]: reset gate, update gate, new gate, hx, hidden new-gate pre-activation)
std::tuple<at::Tensor, at::Tensor> fused_gru_cell(const at::Tensor& igates, const at::Tensor& hgates,
                                                  const at::Tensor& hx, const std::optional<at::Tensor>& b_ih,
                                                  const std::optional<at::Tensor>& b_hh) {
  TORCH_CHECK(igates.dim() == 2 && igates.sizes() == hgates.sizes() && igates.size(1) == 3 * hx.size(-1),
              "_thnn_fused_gru_cell: input_gates and hidden_gates must be [batch, 3 * hidden] with hidden = "
              "hx.size(-1), got ",
              igates.sizes(), ", ", hgates.sizes(), " and hx ", hx.sizes());
  auto ig = with_bias(igates, b_ih).unsafe_chunk(3, 1);
  auto hg = with_bias(hgates, b_hh).unsafe_chunk(3, 1);
  auto reset = (hg[0] + ig[0]).sigmoid();
  auto update = (hg[1] + ig[1]).sigmoid();
  auto new_gate = (ig[2] + hg[2] * reset).tanh();
  auto hy = (hx - new_gate) * update + new_gate;
  note_executed("aten::_thnn_fused_gru_cell");
  return {hy, at::cat({reset, update, new_gate, hx, hg[2]}, 1)};
}

// CUDA's backward formulas on the workspace above: (grad_gates, grad_cx, grad_bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward_impl(const std::optional<at::Tensor>& grad_hy,
                                                                             const std::optional<at::Tensor>& grad_cy,
                                                                             const at::Tensor& cx, const at::Tensor& cy,
                                                                             const at::Tensor& workspace,
                                                                             bool has_bias) {
  if (!(grad_hy && grad_hy->defined()) && !(grad_cy && grad_cy->defined())) return {};
  auto ws = workspace.chunk(4, 1);
  const auto &in = ws[0], &forget = ws[1], &cell = ws[2], &out = ws[3];
  auto gh = grad_hy && grad_hy->defined() ? *grad_hy : at::zeros_like(cx);
  auto tanh_cy = cy.tanh();
  auto g_out = gh * tanh_cy * out * (1 - out);
  auto g_c = gh * out * (1 - tanh_cy * tanh_cy);
  if (grad_cy && grad_cy->defined()) g_c = g_c + *grad_cy;
  auto g_in = g_c * cell * in * (1 - in);
  auto g_forget = g_c * cx * forget * (1 - forget);
  auto g_cell = g_c * in * (1 - cell * cell);
  auto grad_gates = at::cat({g_in, g_forget, g_cell, g_out}, 1);
  note_executed("aten::_thnn_fused_lstm_cell_backward_impl");
  return {grad_gates, g_c * forget, has_bias ? grad_gates.sum(0) : at::Tensor()};
}

// (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  auto ws = workspace.chunk(5, 1);
  const auto &reset = ws[0], &update = ws[1], &new_gate = ws[2], &hx = ws[3], &hn = ws[4];
  auto g_update = grad_hy * (hx - new_gate) * update * (1 - update);
  auto g_new = grad_hy * (1 - update) * (1 - new_gate * new_gate);
  auto g_reset = g_new * hn * reset * (1 - reset);
  auto grad_igates = at::cat({g_reset, g_update, g_new}, 1);
  auto grad_hgates = at::cat({g_reset, g_update, g_new * reset}, 1);
  note_executed("aten::_thnn_fused_gru_cell_backward");
  return {grad_igates, grad_hgates, grad_hy * update, has_bias ? grad_igates.sum(0) : at::Tensor(),
          has_bias ? grad_hgates.sum(0) : at::Tensor()};
}

// oneDNN runs the layer in bfloat16 only where the CPU has bfloat16 instructions (the CPU's own test).
bool bf16_layer_supported() {
  static const bool supported =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_is_mkldnn_bf16_supported", "").typed<bool()>().call();
  return supported;
}

// Whether oneDNN's LSTM layer (what the CPU's nn.LSTM runs) computes this call: the CPU's own conditions (float32
// arguments, oneDNN enabled, no projections, concrete sizes, not empty; under autocast, which casts the layer
// (autocast.cpp), bfloat16 support), no forward-mode tangent (the layer has no forward derivative; the cells do),
// and not traced (fake or functional tensors, a dispatch mode): the layer's results depend on the grad mode, which
// differs between a trace and the compiled forward it becomes (run without grad), so graphs get the cells.
bool sequence_kernel_fits(const at::Tensor& input, at::TensorList hx, at::TensorList params) {
  constexpr c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  if (c10::impl::dispatch_mode_enabled() || input.key_set().has_any(traced)) return false;
  if (at::autocast::is_autocast_enabled(at::kPrivateUse1) &&
      !(at::autocast::get_autocast_dtype(at::kPrivateUse1) == at::kBFloat16 && bf16_layer_supported()))
    return false;
  if (!at::globalContext().userEnabledMkldnn() || input.numel() == 0 || hx.size() != 2 ||
      hx[0].size(-1) != hx[1].size(-1) || input.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
    return false;
  auto plain_float = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.layout() == at::kStrided && !t._fw_grad(0).defined();
  };
  if (!plain_float(input)) return false;
  for (const auto& t : hx)
    if (!plain_float(t)) return false;
  for (const auto& t : params)
    if (!plain_float(t)) return false;
  return true;
}

// at::lstm: each layer and direction one `mkldnn_rnn_layer` (autograd records it with its own backward and double
// backward), dropout between layers as the cells take it; otherwise ATen's cell-by-cell composite.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_sequence(const at::Tensor& input, at::TensorList hx,
                                                             at::TensorList params, bool has_biases, int64_t num_layers,
                                                             double dropout, bool train, bool bidirectional,
                                                             bool batch_first) {
  if (!sequence_kernel_fits(input, hx, params))
    return at::native::lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
  const int64_t directions = bidirectional ? 2 : 1, per_layer = has_biases ? 4 : 2, hidden = hx[0].size(2);
  TORCH_CHECK(static_cast<int64_t>(params.size()) == num_layers * directions * per_layer, "lstm: expected ",
              num_layers * directions * per_layer, " parameter tensors, got ", params.size());
  at::Tensor x = (batch_first ? input.transpose(0, 1) : input).contiguous();
  const at::Tensor h0 = hx[0].contiguous(), c0 = hx[1].contiguous();
  std::vector<at::Tensor> hy, cy, out(directions);
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    for (int64_t d = 0; d < directions; ++d) {
      const int64_t i = layer * directions + d;
      const at::Tensor* w = &params[i * per_layer];
      auto [y, h, c, workspace] = at::mkldnn_rnn_layer(
          x, w[0], w[1], has_biases ? w[2] : at::zeros(w[0].sizes(), w[0].options()),
          has_biases ? w[3] : at::zeros(w[1].sizes(), w[1].options()), h0[i], c0[i], /*reverse=*/d == 1,
          /*batch_sizes=*/{}, /*mode: ideep::rnn_kind::LSTM*/ 2, hidden, num_layers, has_biases, bidirectional,
          /*batch_first=*/false, train);  // x is (seq, batch, feature) here
      out[d] = y, hy.push_back(h), cy.push_back(c);
    }
    x = directions == 1 ? out[0] : at::cat(out, -1);
    if (dropout != 0 && train && layer + 1 < num_layers) x = at::dropout(x, dropout, /*train=*/true);
  }
  return {batch_first ? x.transpose(0, 1) : x, at::stack(hy), at::stack(cy)};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("lstm.input", lstm_sequence);
  m.impl("_thnn_fused_lstm_cell", fused_lstm_cell);
  m.impl("_thnn_fused_gru_cell", fused_gru_cell);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {  // reached directly under torch.inference_mode
  m.impl("lstm.input", lstm_sequence);
  m.impl("_thnn_fused_lstm_cell", fused_lstm_cell);
  m.impl("_thnn_fused_gru_cell", fused_gru_cell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", fused_lstm_cell_backward_impl);
  m.impl("_thnn_fused_gru_cell_backward", fused_gru_cell_backward);
}

}  // namespace torchneuron
