"""F.scaled_dot_product_attention on `neuron` runs the fused `_scaled_dot_product_efficient_attention` (the op DTensor
shards and the compiler knows), forward and backward equal to the CPU's SDPA."""
import pytest
import torch
import torch.nn.functional as F

import torchneuron

CASES = {  # name: (q heads, kv heads, query length, key length, kwargs)
    "plain": (4, 4, 8, 8, {}),
    "causal": (4, 4, 8, 8, {"is_causal": True}),
    "causal_rectangular": (4, 4, 6, 10, {"is_causal": True}),
    "float_mask": (4, 4, 8, 8, {"attn_mask": "float"}),
    "bool_mask": (4, 4, 8, 8, {"attn_mask": "bool"}),
    "scale": (4, 4, 8, 8, {"scale": 0.3}),
}


def inputs(hq: int, hk: int, lq: int, lk: int, kw: dict, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, lq, 16, generator=g, dtype=dtype)
    k, v = (torch.randn(2, hk, lk, 16, generator=g, dtype=dtype) for _ in range(2))
    kw = dict(kw)
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(lq, lk, generator=g, dtype=dtype)
    elif kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(2, 1, lq, lk, generator=g) > 0.3
    return q, k, v, kw


def run(q, k, v, kw, device):
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    kw = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    out = F.scaled_dot_product_attention(*leaves, **kw)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(device, out.dtype))
    return [t.detach().cpu() for t in (out, *(x.grad for x in leaves))]


@pytest.mark.parametrize("case", CASES)
def test_fused_attention_equals_cpu(case):
    q, k, v, kw = inputs(*CASES[case])
    torchneuron.clear_op_tracking()
    dev = run(q, k, v, kw, "neuron")
    ops = torchneuron.get_executed_ops()
    assert ops.get("aten::_scaled_dot_product_efficient_attention") == 1
    assert ops.get("aten::_scaled_dot_product_efficient_attention_backward") == 1
    for d, c in zip(dev, run(q, k, v, kw, "cpu"), strict=True):
        torch.testing.assert_close(d, c, rtol=1e-5, atol=1e-6)


def test_bf16_equals_cpu():
    q, k, v, kw = inputs(4, 4, 8, 8, {"is_causal": True}, torch.bfloat16)
    for d, c in zip(run(q, k, v, kw, "neuron"), run(q, k, v, kw, "cpu"), strict=True):
        torch.testing.assert_close(d, c, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"attn_mask": "float"}], ids=["plain", "causal", "mask"])
def test_dropout_masks_come_from_the_neuron_generator(kw):
    """With dropout the fused op draws its [B, H, L, S] keep-mask from the neuron generator; the backward redraws
    the same mask from the (seed, offset) the forward returned: the result, its log-sum-exp and the gradients match
    the math formula with that mask."""
    q, k, v, kw = inputs(2, 2, 8, 8, kw)
    torch.manual_seed(3)
    state = torch.neuron.get_rng_state()
    dev = run(q, k, v, {**kw, "dropout_p": 0.4}, "neuron")
    torch.neuron.set_rng_state(state)
    bias = kw.get("attn_mask")
    lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        *(t.to("neuron") for t in (q, k, v)), None if bias is None else bias.to("neuron"), True, 0.4,
        kw.get("is_causal", False))[1]
    torch.neuron.set_rng_state(state)
    keep = torch.empty(2, 2, 8, 8, device="neuron").bernoulli_(0.6).bool().cpu()  # the same counters
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-2, -1) / 4
    if kw.get("is_causal"):
        scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    if bias is not None:
        scores = scores + bias
    out = (scores.softmax(-1) * keep / 0.6) @ leaves[2]
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    for d, c in zip(dev, [out.detach(), *(x.grad for x in leaves)], strict=True):
        torch.testing.assert_close(d, c, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.cpu()[..., :8], scores.detach().logsumexp(-1), rtol=1e-5, atol=1e-6)


def test_dropout_under_autocast_computes_in_float():
    """The fused op's own math stays in float under autocast (a compiled graph calls the op itself, which autocast
    passes through): its result equals the same call outside autocast."""
    q, k, v = (t.to("neuron") for t in inputs(2, 2, 8, 8, {})[:3])
    attention = torch.ops.aten._scaled_dot_product_efficient_attention
    state = torch.neuron.get_rng_state()
    with torch.autocast("neuron", dtype=torch.bfloat16):
        inside = attention(q, k, v, None, True, 0.2, True)
    torch.neuron.set_rng_state(state)
    outside = attention(q, k, v, None, True, 0.2, True)
    for a, b in zip(inside[:2], outside[:2], strict=True):
        assert a.dtype == torch.float32 and torch.equal(a.cpu(), b.cpu())


def test_dropout_backward_draws_the_same_mask_again():
    """The backward draws the forward's keep-mask again from (seed, offset): two backwards of the same graph give
    the same gradients."""
    q, k, v, _ = inputs(2, 2, 8, 8, {})
    leaves = [t.to("neuron").requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, dropout_p=0.3)
    g = torch.linspace(-1, 1, out.numel()).view(out.shape).to("neuron")
    grads = []
    for _ in range(2):
        out.backward(g, retain_graph=True)
        grads.append([x.grad.cpu() for x in leaves])
        for x in leaves:
            x.grad = None
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_what_the_fused_op_cannot_do_takes_math_counted():
    q = torch.randn(3, 8, 16, device="neuron")  # 3-D inputs: the fused op takes (batch, heads, seq, dim)
    torchneuron.clear_op_tracking()
    out = F.scaled_dot_product_attention(q, q, q)
    assert torchneuron.get_executed_ops().get("aten::_scaled_dot_product_attention_math") == 1
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q.cpu(), q.cpu(), q.cpu()))


def test_gqa_takes_math_counted():
    """enable_gqa with fewer key/value heads: the fused op's meta kernel (DTensor's sharding propagation, compile)
    cannot express it, so it runs the math decomposition, equal to the CPU's."""
    q, k, v, kw = inputs(4, 2, 8, 8, {"enable_gqa": True, "is_causal": True})
    torchneuron.clear_op_tracking()
    dev = run(q, k, v, kw, "neuron")
    assert torchneuron.get_executed_ops().get("aten::_scaled_dot_product_attention_math") == 1
    for d, c in zip(dev, run(q, k, v, kw, "cpu"), strict=True):
        torch.testing.assert_close(d, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [{"is_causal": True}, {"enable_gqa": True}], ids=["causal", "gqa"])
def test_compiled_attention_equals_eager(kw):
    q, k, v, kw = inputs(4, 2 if "enable_gqa" in kw else 4, 8, 8, kw)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kw).relu().sum()

    grads = []
    for fn in (f, torch.compile(f, backend="neuron")):
        leaves = [t.to("neuron").requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward()
        grads.append([x.grad.cpu() for x in leaves])
    for e, c in zip(*grads, strict=True):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shapes", [((2, 4, 8, 16), (3, 4, 8, 16), (3, 4, 8, 16)),  # batch
                                    ((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 9, 16)),  # key/value length
                                    ((2, 4, 8, 16), (2, 4, 8, 8), (2, 4, 8, 16)),   # query/key embedding
                                    ((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16), (3, 8, 8))],  # mask
                         ids=["batch", "length", "embedding", "mask"])
def test_mismatched_shapes_raise_at_the_call(shapes):
    """The fused kernel is queued: what it would fail on is raised at the launch, not at a later sync point. (The
    CPU raises for these too, except unequal key and value lengths, which its flash kernel does not check.)"""
    q, k, v, *mask = (torch.randn(s) for s in shapes)
    kw = {"attn_mask": mask[0]} if mask else {}
    with pytest.raises(RuntimeError) as e:
        F.scaled_dot_product_attention(q.to("neuron"), k.to("neuron"), v.to("neuron"),
                                       **{n: t.to("neuron") for n, t in kw.items()})
    assert "asynchronously" not in str(e.value)
    torch.neuron.synchronize()  # nothing was queued that fails later


@pytest.mark.parametrize("last", [8, 16, 13])
def test_fused_results_have_the_meta_kernels_layouts(last):
    """Compiled graphs are compiled for the layouts the fused ops' meta kernels promise (PyTorch's, shared with CUDA):
    the device's results have them, the bias gradient included (its last dimension padded to 16)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, last, 8, generator=g) for _ in range(3))
    bias = torch.randn(2, 4, last, last, generator=g)
    fwd = torch.ops.aten._scaled_dot_product_efficient_attention
    bwd = torch.ops.aten._scaled_dot_product_efficient_attention_backward
    layouts = {}
    for device in ("meta", "neuron"):
        qd, kd, vd, bd = (t.to(device) for t in (q, k, v, bias))
        out, lse, seed, offset = fwd(qd, kd, vd, bd, True, 0.0, False)
        grads = bwd(torch.ones_like(out), qd, kd, vd, bd, out, lse, seed, offset, 0.0, [True] * 4, False)
        layouts[device] = [(tuple(t.shape), t.stride()) for t in (out, lse, *grads)]
    assert layouts["neuron"] == layouts["meta"]
    ref = torch.func.grad(lambda b: F.scaled_dot_product_attention(q, k, v, attn_mask=b).sum())(bias)
    torch.testing.assert_close(grads[3].cpu(), ref, rtol=1e-4, atol=1e-5)
