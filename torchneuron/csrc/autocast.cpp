// Autocast for `torch.autocast("neuron")`: the same op policy as CUDA (ATen's shared op lists), registered on
// AutocastPrivateUse1, plus a fallthrough so every other op runs unchanged inside an autocast region.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace torchneuron {
using at::IntArrayRef;  // the names ATen's op-list macros expect in scope
using at::Scalar;
using at::ScalarType;
using at::Tensor;
namespace {
// As on CUDA: binary_cross_entropy is unsafe in lower precision, so autocast refuses it with the standard advice.
at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                       int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
              "Many models use a sigmoid layer right before the binary cross entropy layer. In this case, combine "
              "the two layers using torch.nn.functional.binary_cross_entropy_with_logits or "
              "torch.nn.BCEWithLogitsLoss, which are safe to autocast.");
}
}  // namespace

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define NEURON_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(NEURON_LOWER_PRECISION_FP)
#define NEURON_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(NEURON_FP32)
#define NEURON_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(NEURON_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#define NEURON_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(NEURON_PROMOTE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(binary_cross_entropy_banned));
  // nn.LSTM's sequence kernel (rnn.cpp) in the autocast dtype, as CUDA's cuDNN RNN and the CPU's oneDNN one run
  KERNEL_PRIVATEUSEONE(mkldnn_rnn_layer, lower_precision_fp)
}

}  // namespace torchneuron
