// Convolution as an explicit kernel in stream order: ATen routes devices other than the CPU and CUDA to the
// *_overrideable ops, which run the CPU's convolution (its algorithm choice, its results) on host aliases.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "handed_out.h"
#include "runtime.h"

namespace torchneuron {
namespace {

bool is_neuron(const at::Tensor& t) { return t.device().type() == kNeuron; }

// An explicit kernel in stream order. The layouts of its results are those of the first call with the same
// signature on this thread (the CPU's algorithm choice decides them), which runs on this thread after the stream's
// work and adopts the CPU's results; later calls allocate their results at the launch and queue `compute` (host
// tensors in, host results out, made in the launch's memory where the CPU allocator can: handed_out.h), copying a
// result made elsewhere into it (below autograd, as every queued kernel runs). A profiler trace runs every call on
// this thread.
struct ResultShape {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  bool defined;
};
template <class Compute>
std::vector<at::Tensor> explicit_kernel(const char* name, c10::DeviceIndex dev, std::vector<int64_t> key,
                                        int64_t elements, const std::vector<c10::IValue>& inputs, Compute compute) {
  thread_local std::map<std::pair<const char*, std::vector<int64_t>>, std::vector<ResultShape>> seen;
  note_executed(name);
  at::AutoDispatchBelowADInplaceOrView below;
  auto it = seen.find({name, key});
  Access acc;
  for (const c10::IValue& v : inputs)
    if (v.isTensor() && v.toTensor().defined() && is_neuron(v.toTensor()))
      acc.push_back(touch(v.toTensor(), true, false));
  if (current_queue(dev).idle()) raise_if_poisoned(acc, name);  // else the worker decides
  if (it == seen.end() || g_tracing_device.load(std::memory_order_relaxed)) {
    current_queue(dev).wait_quiet(current_queue(dev).enqueued());  // not a sync point: a pending error waits for one
    raise_if_poisoned(acc, name);
    KernelEvent event(name, dev, nullptr, inputs);
    std::vector<at::Tensor> res;
    {
      KernelThreadsGuard threads(elements);  // the threads its queued calls run with
      res = with_device_oom(dev, compute);
    }
    std::vector<ResultShape> shapes;
    for (auto& r : res) {
      if (!r.defined()) {
        shapes.push_back({{}, {}, at::kFloat, false});
        continue;
      }
      shapes.push_back({r.sizes().vec(), r.strides().vec(), r.scalar_type(), true});
      r = adopt_host_tensor(r, dev);
    }
    event.end(std::vector<c10::IValue>(res.begin(), res.end()));
    if (seen.size() >= 256) seen.clear();  // a bounded memo that keeps learning: new shapes are always remembered
    seen.emplace(std::make_pair(name, std::move(key)), std::move(shapes));
    return res;
  }
  std::vector<at::Tensor> res, dst;
  for (const ResultShape& r : it->second) {
    res.push_back(r.defined ? at::empty_strided(r.sizes, r.strides, at::TensorOptions(r.dtype).device(kNeuron, dev))
                            : at::Tensor());
    dst.push_back(on_host(res.back()));
    if (res.back().defined()) acc.push_back(touch(res.back(), false, true));
  }
  launch(dev, name, elements, std::move(acc), [dev, name, compute = std::move(compute), dst = std::move(dst)] {
    std::vector<void*> blocks;
    std::vector<size_t> bytes;
    for (const at::Tensor& d : dst)
      if (d.defined()) blocks.push_back(d.storage().mutable_data()), bytes.push_back(d.storage().nbytes());
    std::vector<at::Tensor> out;
    with_handed_out(blocks, bytes, [&] { out = with_device_oom(dev, compute); });
    auto in_place = [&](size_t i) {
      return out[i].data_ptr() == dst[i].data_ptr() && out[i].strides() == dst[i].strides();
    };
    bool misplaced = false;  // a result made in another's block (or at other strides in its own): read all first
    for (size_t i = 0; i < dst.size(); ++i)
      misplaced |= dst[i].defined() && block_of(out[i], blocks) >= 0 && !in_place(i);
    for (size_t i = 0; i < dst.size(); ++i)
      if (misplaced && block_of(out[i], blocks) >= 0) out[i] = out[i].clone();
    for (size_t i = 0; i < dst.size(); ++i)
      if (dst[i].defined() && (misplaced || !in_place(i))) dst[i].copy_(out[i]);
    out.clear();
    check_handed_out_released(blocks, name);
  });
  return res;
}

// A tensor's part of a kernel signature: dtype, sizes and strides (-1 for none).
void add_to_key(std::vector<int64_t>& key, const at::Tensor& t) {
  if (!t.defined()) return key.push_back(-1);
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.dim());
  key.insert(key.end(), t.sizes().begin(), t.sizes().end());
  key.insert(key.end(), t.strides().begin(), t.strides().end());
}

std::vector<int64_t> conv_key(std::initializer_list<at::Tensor> tensors, at::IntArrayRef stride,
                              at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                              at::IntArrayRef output_padding, int64_t groups) {
  std::vector<int64_t> key;
  for (const at::Tensor& t : tensors) add_to_key(key, t);
  for (at::IntArrayRef a : {stride, padding, dilation, output_padding}) {
    key.push_back(static_cast<int64_t>(a.size()));
    key.insert(key.end(), a.begin(), a.end());
  }
  key.push_back(transposed), key.push_back(groups), key.push_back(at::globalContext().userEnabledMkldnn());
  return key;
}

at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                       at::IntArrayRef output_padding, int64_t groups) {
  const at::Tensor b = bias.value_or(at::Tensor());
  auto dev = check_same_device("aten::convolution", {input, weight, b});
  auto key = conv_key({input, weight, b}, stride, padding, dilation, transposed, output_padding, groups);
  auto compute = [i = on_host(input), w = on_host(weight), b = on_host(b), stride = stride.vec(),
                  padding = padding.vec(), dilation = dilation.vec(), transposed, output_padding = output_padding.vec(),
                  groups] {
    return std::vector<at::Tensor>{at::convolution(i, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt,
                                                   stride, padding, dilation, transposed, output_padding, groups)};
  };
  return explicit_kernel("aten::convolution", dev, std::move(key), input.numel() * weight.size(0),
                         {input, weight, bias}, std::move(compute))[0];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(const at::Tensor& grad_output,
                                                                    const at::Tensor& input, const at::Tensor& weight,
                                                                    at::IntArrayRef stride, at::IntArrayRef padding,
                                                                    at::IntArrayRef dilation, bool transposed,
                                                                    at::IntArrayRef output_padding, int64_t groups,
                                                                    std::array<bool, 3> mask) {
  auto dev = check_same_device("aten::convolution_backward", {grad_output, input, weight});
  auto key = conv_key({grad_output, input, weight}, stride, padding, dilation, transposed, output_padding, groups);
  key.insert(key.end(), mask.begin(), mask.end());
  auto compute = [g = on_host(grad_output), i = on_host(input), w = on_host(weight), stride = stride.vec(),
                  padding = padding.vec(), dilation = dilation.vec(), transposed, output_padding = output_padding.vec(),
                  groups, mask] {
    std::vector<int64_t> bias_sizes{transposed ? w.size(1) * groups : w.size(0)};
    auto [gi, gw, gb] = at::convolution_backward(g, i, w, bias_sizes, stride, padding, dilation, transposed,
                                                 output_padding, groups, mask);
    return std::vector<at::Tensor>{gi, gw, gb};
  };
  auto res = explicit_kernel("aten::convolution_backward", dev, std::move(key), grad_output.numel() * weight.size(1),
                             {grad_output, input, weight}, std::move(compute));
  return {res[0], res[1], res[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution_overrideable", convolution);
  m.impl("convolution_backward_overrideable", convolution_backward);
}

}  // namespace torchneuron
