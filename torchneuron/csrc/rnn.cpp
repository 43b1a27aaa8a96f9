// The fused RNN cells ATen's RNN.cpp uses for every accelerator input (nn.LSTM, nn.GRU, LSTMCell, GRUCell take
// `_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell` when the input is CUDA, XPU or PrivateUse1; the CPU has no
// kernel for them). On neuron each cell is the CPU's own unfused arithmetic, in the CPU's order (biases added to
// each matmul, then hidden + input gates, then the activations), registered at the autograd level so the ops
// below are recorded like any other: the gradients are the CPU's, double backward works, autocast has already
// cast the inputs, and torch.compile traces plain aten ops. The workspace output has CUDA's layout (activated
// gates; for GRU also hx and the hidden new gate) so the CUDA-style backward kernels below accept it.
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

}  // namespace

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_thnn_fused_lstm_cell", fused_lstm_cell);
  m.impl("_thnn_fused_gru_cell", fused_gru_cell);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {  // reached directly under torch.inference_mode
  m.impl("_thnn_fused_lstm_cell", fused_lstm_cell);
  m.impl("_thnn_fused_gru_cell", fused_gru_cell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", fused_lstm_cell_backward_impl);
  m.impl("_thnn_fused_gru_cell_backward", fused_gru_cell_backward);
}

}  // namespace torchneuron
