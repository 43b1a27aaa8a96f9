"""torch.autocast("neuron") with CUDA's op policy, and torch.amp.GradScaler("neuron")."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_policy_matches_cuda_lists(dtype):
    a = torch.randn(8, 8, device="neuron")
    with torch.autocast("neuron", dtype=dtype):
        assert (a @ a).dtype == dtype                      # lower_precision_fp
        assert F.linear(a, a).dtype == dtype
        assert torch.softmax(a, -1).dtype == torch.float32  # fp32
        assert torch.exp(a.to(dtype)).dtype == torch.float32
        assert torch.addcmul(a, a.to(dtype), a).dtype == torch.float32  # promote to widest
        assert (a + a).dtype == torch.float32               # untouched ops run as they are
    assert (a @ a).dtype == torch.float32


def test_autocast_numerics_match_cpu_autocast_cast():
    torch.manual_seed(0)
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    with torch.autocast("neuron", dtype=torch.bfloat16):
        dev = a.neuron() @ b.neuron()
    ref = a.bfloat16() @ b.bfloat16()
    assert torch.equal(dev.cpu(), ref)


def test_conv_and_training_under_autocast():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).neuron()
    x = torch.randn(2, 3, 8, 8, device="neuron")
    with torch.autocast(device_type="neuron", dtype=torch.bfloat16):
        out = m(x)
        loss = F.cross_entropy(out, torch.tensor([0, 1], device="neuron"))
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert m[0].weight.grad.dtype == torch.float32


def test_binary_cross_entropy_is_refused_like_cuda():
    p = torch.rand(4, device="neuron")
    with torch.autocast("neuron"), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, p)


def test_grad_scaler_unscales_and_skips_inf_steps():
    m = nn.Linear(4, 1).neuron()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("neuron", init_scale=1024.0)
    w0 = m.weight.detach().clone()
    loss = m(torch.ones(2, 4, device="neuron")).sum()
    scaler.scale(loss).backward()
    assert torch.allclose(m.weight.grad.cpu(), torch.full((1, 4), 2.0 * 1024))
    scaler.step(opt)
    scaler.update()
    assert torch.allclose((w0 - m.weight.detach()).cpu(), torch.full((1, 4), 0.2))  # unscaled gradient used
    assert scaler.get_scale() == 1024.0
    m.weight.grad = torch.full_like(m.weight, float("inf"))
    w1 = m.weight.detach().clone()
    scaler.step(opt)  # inf gradients: the step is skipped and the scale backs off
    scaler.update()
    assert torch.equal(m.weight.detach().cpu(), w1.cpu()) and scaler.get_scale() == 512.0


def test_grad_scaler_steps_without_dtype_events():
    """GradScaler takes its scale's reciprocal in float64 (torch's own precision choice): an fp16 AMP step on
    neuron warned "aten::reciprocal produced float64 values" and counted dtype events every step. It is torch's
    math, not the program's: no event, no warning, and the unscaled gradients are exact (a power-of-two scale)."""
    import warnings

    import torchneuron

    torch.manual_seed(0)
    m = nn.Linear(8, 4).to("neuron")
    x = torch.randn(16, 8, device="neuron")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("neuron", init_scale=2.0**14)
    m(x).float().pow(2).mean().backward()
    plain = m.weight.grad.cpu().clone()
    opt.zero_grad()
    before = dict(torchneuron.get_dtype_events())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(m(x).float().pow(2).mean()).backward()
        scaler.unscale_(opt)
        assert torch.allclose(m.weight.grad.cpu(), plain, rtol=1e-5, atol=1e-7)
        scaler.step(opt)
        scaler.update()
    assert torchneuron.get_dtype_events() == before
