"""List ops (`torch._foreach_*`, what optimizers and gradient clipping call) run on `neuron` as one kernel each, as
CUDA's multi-tensor kernels do, with the CPU's results (the op table's `one_kernel`, routed to the fallback)."""
from __future__ import annotations

import pytest
import torch

import torchneuron

SHAPES = [(3, 4), (7,), (2, 3, 5), ()]


def tensors(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(s, generator=g, dtype=torch.float32).add(0.5).to(dtype) for s in SHAPES]


CASES = {  # name: (fn over lists a, b, c, in-place or not)
    "add_scalar_": lambda a, b, c: torch._foreach_add_(a, 2.5),
    "add_list_alpha_": lambda a, b, c: torch._foreach_add_(a, b, alpha=0.3),
    "mul_scalarlist_": lambda a, b, c: torch._foreach_mul_(a, [1.0, 2.0, 3.0, 4.0]),
    "div_list_": lambda a, b, c: torch._foreach_div_(a, b),
    "sub_scalar": lambda a, b, c: torch._foreach_sub(a, 1.0),
    "lerp_": lambda a, b, c: torch._foreach_lerp_(a, b, 0.1),
    "addcmul_": lambda a, b, c: torch._foreach_addcmul_(a, b, c, value=0.2),
    "addcdiv_scalarlist_": lambda a, b, c: torch._foreach_addcdiv_(a, b, c, [0.5, -1.0, 2.0, 0.1]),
    "addcdiv_host_scalars_": lambda a, b, c: torch._foreach_addcdiv_(a, b, c, torch.tensor([0.5, -1.0, 2.0, 0.1])),
    "sqrt": lambda a, b, c: torch._foreach_sqrt(a),
    "norm": lambda a, b, c: torch._foreach_norm(a, 2),
    "maximum": lambda a, b, c: torch._foreach_maximum(a, b),
    "pow_": lambda a, b, c: torch._foreach_pow_(a, 2.0),
    "clamp_min_": lambda a, b, c: torch._foreach_clamp_min_(a, 0.9),
    "zero_": lambda a, b, c: torch._foreach_zero_(a),
}
ONE_KERNEL = {"addcdiv_host_scalars_": False}  # its `Tensor scalars` is a host tensor: ATen's composite runs it


@pytest.mark.parametrize("case", CASES)
def test_list_op_is_one_kernel_with_the_cpus_results(case):
    fn = CASES[case]
    cpu = [tensors(i) for i in range(3)]
    dev = [[t.to("neuron") for t in ts] for ts in cpu]
    ref = fn(*cpu)
    torchneuron.clear_op_tracking()
    out = fn(*dev)
    name = "aten::_foreach_" + case.split("_scalar")[0].split("_list")[0].rstrip("_").removesuffix("_host") + (
        "_" if case.endswith("_") else "")
    ran = torchneuron.get_executed_ops()
    if ONE_KERNEL.get(case, True):
        assert ran == {name: 1}, ran
    else:
        assert name not in ran and sum(ran.values()) == len(SHAPES), ran  # one device op per tensor
    for d, c in zip(dev[0], cpu[0], strict=True):  # the in-place results
        assert torch.equal(d.cpu(), c)
    if ref is not None:
        for d, c in zip(out, ref, strict=True):
            assert d.device.type == "neuron" and torch.equal(d.cpu(), c)


def test_optimizer_steps_match_the_cpu_and_launch_a_kernel_per_list_op():
    torch.manual_seed(0)
    params = [torch.randn(s, requires_grad=True) for s in ((16, 8), (8,), (4, 4))]
    runs = {}
    for device in ("cpu", "neuron"):
        ps = [p.detach().clone().to(device).requires_grad_() for p in params]
        opt = torch.optim.AdamW(ps, lr=0.1, foreach=True)
        for i in range(3):
            for p in ps:
                p.grad = torch.full_like(p, 0.1 * (i + 1))
            torchneuron.clear_op_tracking()
            opt.step()  # (the first also makes the optimizer's state)
        runs[device] = [p.detach().cpu() for p in ps]
    for n, c in zip(runs["neuron"], runs["cpu"], strict=True):
        assert torch.equal(n, c)
    ran = torchneuron.get_executed_ops()
    assert all(k.startswith("aten::_foreach_") for k in ran), ran  # no per-tensor ops
    assert max(ran.values()) <= 2, ran  # one kernel per list op of the step


def test_a_list_op_over_tensors_on_two_devices_raises_like_cuda():
    a = [torch.ones(3, device="neuron"), torch.ones(3)]
    with pytest.raises(RuntimeError, match="same device|devices"):
        torch._foreach_add_(a, 1.0)


@pytest.mark.needs_async
@pytest.mark.parametrize("op", ["sqrt", "exp", "neg", "reciprocal", "abs"])
def test_a_unary_list_op_queued_writes_its_new_tensors_in_place(op):
    """A unary list op returning new tensors (Adam's `_foreach_sqrt` every step), queued behind work: each tensor's
    pointwise out= kernel (the CPU list kernel's own, per tensor) writes into the results' device memory, nothing is
    made elsewhere and copied in (`_C._copied_ops`), and the bits are the CPU's."""
    fn = getattr(torch, f"_foreach_{op}")
    cpu = [t * 3 - 1 for t in tensors(0)] + [torch.randn(300, 200, generator=torch.Generator().manual_seed(1))]
    dev = [t.to("neuron") for t in cpu]
    w = torch.randn(1024, 1024, device="neuron") / 32
    for _ in range(3):  # the first calls behind work learn the results' layout; the last is queued
        busy = w
        for _ in range(4):
            busy = torch.tanh(busy @ w)
        torchneuron.clear_op_tracking()
        out = fn(dev)
    assert torchneuron._C._queued_ops().get(f"aten::_foreach_{op}") == 1
    torch.neuron.synchronize()
    assert f"aten::_foreach_{op}" not in torchneuron._C._copied_ops()
    for d, c in zip(out, fn(cpu), strict=True):  # (sqrt of the negatives: NaN on both)
        assert d.device.type == "neuron" and d.stride() == c.stride()
        torch.testing.assert_close(d.cpu(), c, rtol=0, atol=0, equal_nan=True)


def _many(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """40 tensors (more than the 16 a call's tensor maps scan before they hash: csrc/runtime.h SmallMap) that alias:
    three views of one base, and one tensor listed twice."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(6, 5, generator=g) + 0.5
    ts = [torch.rand(3 + i % 4, generator=g) + 0.5 for i in range(37)]
    ts[2], ts[20], ts[33] = base[0], base[3], base[:, 1]  # views of one storage, far apart in the list
    return base, ts + [ts[7], base[5], ts[11]]  # ts[7] and ts[11] again, and a fourth view


@pytest.mark.parametrize("mode", ["idle", "queued"])
def test_list_ops_over_many_aliasing_tensors_match_the_cpu(mode):
    """A list op over dozens of tensors (an HF model's optimizer step) takes the same aliasing decisions as over a few:
    one CPU tensor per device tensor listed twice, one CPU storage per device storage for views, results that are
    views or fresh memory as on the CPU, on the host path and queued behind work (the signature's and the result
    layout's alias numbering)."""
    cpu_base, cpu = _many(0)
    _, cpu_b = _many(1)
    dev_base = cpu_base.to("neuron")
    dev = [dev_base[0], dev_base[3], dev_base[:, 1], dev_base[5]]
    dev_map = {id(t): d for t, d in zip((cpu[2], cpu[20], cpu[33], cpu[38]), dev, strict=True)}
    devs = [dev_map.get(id(t)) for t in cpu]
    plain = {}
    for i, t in enumerate(cpu):
        if devs[i] is None:
            devs[i] = plain.setdefault(id(t), t.to("neuron"))
    dev_b = [t.to("neuron") for t in cpu_b]
    w = torch.randn(512, 512, device="neuron") / 23
    for _ in range(3):  # the third call of the signature is queued when the stream is busy
        if mode == "queued":
            busy = w
            for _ in range(3):
                busy = torch.tanh(busy @ w)
        got = torch._foreach_mul(devs, dev_b)
        torch._foreach_add_(devs, dev_b, alpha=0.5)
        ref = torch._foreach_mul(cpu, cpu_b)
        torch._foreach_add_(cpu, cpu_b, alpha=0.5)
        for d, c in zip(got, ref, strict=True):
            torch.testing.assert_close(d.cpu(), c, rtol=0, atol=0)
    torch.testing.assert_close(dev_base.cpu(), cpu_base, rtol=0, atol=0)  # views and repeats written as on the CPU
    for d, c in zip(devs, cpu, strict=True):
        torch.testing.assert_close(d.cpu(), c, rtol=0, atol=0)


def test_fused_adamw_over_many_parameters_matches_the_cpu():
    """`AdamW(fused=True)` (HF Trainer's default optimizer) over 40 parameters: the fused kernel's in-place writes of
    every list land in each parameter's and state's own device memory."""
    torch.manual_seed(0)
    params = [torch.randn(2 + i % 5, 3) for i in range(40)]
    runs = {}
    for device in ("cpu", "neuron"):
        ps = [p.clone().to(device).requires_grad_() for p in params]
        opt = torch.optim.AdamW(ps, lr=0.05, fused=True)
        for i in range(3):
            for j, p in enumerate(ps):
                p.grad = torch.full_like(p, 0.01 * (i + 1) * (j + 1))
            opt.step()
        runs[device] = [p.detach().cpu() for p in ps] + [opt.state[p]["exp_avg_sq"].cpu() for p in ps]
    for n, c in zip(runs["neuron"], runs["cpu"], strict=True):
        torch.testing.assert_close(n, c, rtol=0, atol=0)
