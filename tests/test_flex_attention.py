"""FlexAttention on `neuron`, eager and under `torch.compile(backend="neuron")`: the attention-gym mask and score
variants, forward and gradients, against a dense reference on the CPU (the scores materialised in float64 by the
same user functions over broadcast index tensors, masked, softmax: PyTorch's CPU cannot run FlexAttention's
backward itself). Block masks built on the device equal the CPU's."""
from __future__ import annotations

import math
import sys

import pytest
import torch
import torch._dynamo
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import torchneuron  # noqa: F401
from torchneuron.device import flex_attention as neuron_flex
from torchneuron.runtime import patches

N = "neuron"
B, H, L, E = 2, 4, 256, 16  # two 128-token blocks per side: block sparsity is exercised
DOCS = (100, 60, 96)  # document lengths of the packed sequence
WINDOW, PREFIX, SOFTCAP = 64, 80, 3.0
TOL = {"rtol": 1e-4, "atol": 1e-5}


def variant(name: str, device: str, dtype: torch.dtype = torch.float32) -> tuple:
    """(score_mod or None, mask_mod or None, learnt tensors the mods read) of an attention-gym variant, with the
    tensors they capture on `device`."""
    doc = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS)).to(device)
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], dtype=dtype, device=device)
    g = torch.Generator().manual_seed(1)
    rel = torch.randn(H, 2 * L - 1, generator=g).to(device, dtype).requires_grad_()

    def causal(b, h, q, kv):
        return q >= kv

    def sliding_window(b, h, q, kv):
        return (q >= kv) & (q - kv <= WINDOW)

    def document(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    def prefix_lm(b, h, q, kv):
        return (kv < PREFIX) | (q >= kv)

    def alibi(score, b, h, q, kv):
        return score + slopes[h] * (kv - q)

    def softcap(score, b, h, q, kv):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def relative_bias(score, b, h, q, kv):  # a learnt bias (T5-style): its gradient flows through the score mod
        return score + rel[h, q - kv + L - 1]

    return {"causal": (None, causal, []), "sliding_window": (None, sliding_window, []),
            "document": (None, document, []), "prefix_lm": (None, prefix_lm, []),
            "alibi": (alibi, causal, []), "softcap": (softcap, None, []),
            "relative_bias": (relative_bias, causal, [rel])}[name]


VARIANTS = ["causal", "sliding_window", "document", "prefix_lm", "alibi", "softcap", "relative_bias"]


def inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, L, E, generator=g) for _ in range(3)]


def dense_reference(name: str) -> list[torch.Tensor]:
    """Output and gradients (q, k, v, learnt tensors) of the dense formula on the CPU, in float64."""
    score_mod, mask_mod, learnt = variant(name, "cpu", torch.float64)
    q, k, v = (t.double().requires_grad_() for t in inputs())
    b, h, i, j = (torch.arange(n).view(*[-1 if d == a else 1 for d in range(4)]) for a, n in enumerate((B, H, L, L)))
    s = q @ k.transpose(-2, -1) / math.sqrt(E)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j), float("-inf"))
    out = torch.softmax(s, -1) @ v
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape))
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad, *(x.grad for x in learnt))]


def run(name: str, compiled: bool) -> list[torch.Tensor]:
    score_mod, mask_mod, learnt = variant(name, N)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, B, H, L, L, device=N)
    q, k, v = (t.to(N).requires_grad_() for t in inputs())
    fn = torch.compile(flex_attention, backend=N) if compiled else flex_attention
    out = fn(q, k, v, score_mod=score_mod, block_mask=block_mask)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(N))
    return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad, *(x.grad for x in learnt))]


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    torch.neuron.reset_dynamo_metrics()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", VARIANTS)
def test_eager_matches_dense_reference(name):
    torchneuron.clear_op_tracking()
    got = run(name, compiled=False)
    torch.testing.assert_close(got, dense_reference(name), **TOL)
    assert not torchneuron.get_fallback_ops()  # every op of the dense implementation is a device op


@pytest.mark.parametrize("name", VARIANTS)
def test_compiled_matches_dense_reference(name):
    got = run(name, compiled=True)
    torch.testing.assert_close(got, dense_reference(name), **TOL)
    rows = torch.neuron.get_dynamo_metrics()
    assert rows and all(r["fallback"] is None for r in rows)
    assert sum(r["eager_nodes"] for r in rows) == 2  # the forward and the backward higher-order ops


def test_compiled_in_a_model_with_kernels_around_it():
    """flex_attention between compiled kernels (projections, scaling), plain torch.compile (routed to neuron)."""
    _, mask_mod, _ = variant("document", N)
    block_mask = create_block_mask(mask_mod, B, H, L, L, device=N)
    _, cpu_mask, _ = variant("document", "cpu")
    cpu_block_mask = create_block_mask(cpu_mask, B, H, L, L, device="cpu")
    torch.manual_seed(0)
    proj = torch.nn.Linear(E, 3 * E)

    def step(x, p, bm, attend):
        q, k, v = p(x).chunk(3, -1)
        return (attend(q * 1.5, k, v, block_mask=bm).relu() * 2).sum()

    x = torch.randn(B, H, L, E)
    model = torch.nn.Linear(E, 3 * E).to(N)
    model.load_state_dict(proj.state_dict())
    torch.compile(step)(x.to(N), model, block_mask, flex_attention).backward()
    rows = torch.neuron.get_dynamo_metrics()
    assert rows and all(r["fallback"] is None for r in rows) and sum(r["kernels"] for r in rows) >= 2

    def dense(q, k, v, block_mask):  # CPU reference: SDPA with the dense document-causal mask
        i = torch.arange(L)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=cpu_mask(0, 0, i[:, None], i))

    step(x, proj, cpu_block_mask, dense).backward()
    for p, ref in zip(model.parameters(), proj.parameters(), strict=True):
        # each gradient sums 2048 rows of O(1) terms, in another order than the CPU's matmul: atol 1e-4
        torch.testing.assert_close(p.grad.cpu(), ref.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "prefix_lm"])
def test_block_mask_built_on_the_device_equals_the_cpus(name):
    masks = [create_block_mask(variant(name, d)[1], B, H, L, L, device=d) for d in (N, "cpu")]
    for a, b in zip(*(m.as_tuple() for m in masks), strict=True):
        if isinstance(a, torch.Tensor):
            assert a.device.type == N and torch.equal(a.cpu(), b)
        elif not callable(a):
            assert a == b


def test_device_check_is_widened_only_for_neuron_and_undone():
    """The patch accepts neuron and leaves torch's answer for every other device (CPU still refuses a backward,
    an unknown device is still refused); undone, neuron is refused again as torch refuses it."""
    module = sys.modules["torch.nn.attention.flex_attention"]
    q = torch.randn(1, 1, 128, 16, device=N, requires_grad=True)
    module._validate_device(q, q, q)
    cpu = q.detach().cpu().requires_grad_()
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        module._validate_device(cpu, cpu, cpu)
    meta = torch.empty(1, 1, 128, 16, device="meta")
    with pytest.raises(ValueError, match="only supported on"):
        module._validate_device(meta, meta, meta)
    patches.undo(neuron_flex.WIDEN_DEVICE_CHECK)
    try:
        with pytest.raises(ValueError, match="only supported on"):
            flex_attention(q, q, q)
    finally:
        patches.apply(neuron_flex.WIDEN_DEVICE_CHECK)
    assert flex_attention(q, q, q).device.type == N


def test_module_imported_after_torch_is_patched_by_the_hook():
    """`import torch` does not import flex_attention; its first import is patched (a fresh process)."""
    from conftest import run_py

    out = run_py("""
        import sys, torch
        print('torch.nn.attention.flex_attention' in sys.modules)
        from torch.nn.attention.flex_attention import flex_attention
        q = torch.randn(1, 2, 128, 8, device='neuron')
        print(flex_attention(q, q, q).device)
    """).stdout.split()
    assert out == ["False", "neuron:0"]


class _Block(torch.nn.Module):
    """A llama-style block attending the way torchtitan's FlexAttention does: packed tokens [T, N, H] taken to
    [1, N, T, H] at the kernel boundary, grouped-query heads, a class-level compiled flex_attention."""

    HEADS, KV_HEADS, DIM = 4, 2, 32

    def __init__(self):
        super().__init__()
        hd = self.DIM // self.HEADS
        self.norm = torch.nn.RMSNorm(self.DIM)
        self.wqkv = torch.nn.Linear(self.DIM, (self.HEADS + 2 * self.KV_HEADS) * hd, bias=False)
        self.wo = torch.nn.Linear(self.DIM, self.DIM, bias=False)
        self.ffn = torch.nn.Sequential(torch.nn.Linear(self.DIM, 64), torch.nn.SiLU(), torch.nn.Linear(64, self.DIM))

    def forward(self, x, mask, attend):
        hd = self.DIM // self.HEADS
        q, k, v = self.wqkv(self.norm(x)).split([self.HEADS * hd, self.KV_HEADS * hd, self.KV_HEADS * hd], -1)
        q, k, v = (t.view(t.shape[0], -1, hd).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = attend(q, k, v, block_mask=mask, enable_gqa=True)
        h = x + self.wo(out.squeeze(0).transpose(0, 1).reshape(x.shape))
        return h + self.ffn(h)


def _packed_document_causal(positions: torch.Tensor):
    """torchtitan's mask for packed documents: positions restart at 0 at each document; a key is visible from the
    start of the query's document up to the query (the lower bound through a scattered table of document starts)."""
    starts = positions == 0
    doc = torch.cumsum(starts.int(), 0).to(torch.int32) - 1
    first = torch.full((positions.shape[0] + 1,), positions.shape[0], dtype=torch.int32, device=positions.device)
    first.scatter_(0, torch.where(starts, doc, torch.full_like(doc, positions.shape[0])).long(),
                   torch.where(starts, torch.arange(positions.shape[0], dtype=torch.int32, device=positions.device),
                               torch.full_like(doc, positions.shape[0])))

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (kv >= first[doc[q]])

    return mask_mod


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_torchtitan_attention_pattern_trains_like_the_cpu(compiled):
    """Three AdamW steps of a two-block model on a packed batch of three documents: neuron (FlexAttention with the
    block mask from a compiled create_block_mask, as torchtitan builds it) against the CPU (dense SDPA, same mask)."""
    T = 256
    positions = torch.cat([torch.arange(n) for n in (100, 60, 96)])
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(T, _Block.DIM, generator=g), torch.randn(T, _Block.DIM, generator=g)
    torch.manual_seed(0)
    base = torch.nn.ModuleList([_Block(), _Block()])
    compiled_flex = torch.compile(flex_attention, options={"max_autotune": True})  # torchtitan's options: ignored

    def dense(q, k, v, block_mask, enable_gqa):
        i = torch.arange(T)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=_packed_document_causal(positions)(0, 0, i[:, None], i), enable_gqa=enable_gqa)

    results = {}
    for device in ("cpu", N):
        model = __import__("copy").deepcopy(base).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mask = None
        if device == N:
            mask = torch.compile(create_block_mask)(_packed_document_causal(positions.to(N)), 1, None, T, T,
                                                    device=N)

        def step(xd, td, model=model, mask=mask, attend=dense if device == "cpu" else compiled_flex):
            h = xd
            for block in model:
                h = block(h, mask, attend)
            return torch.nn.functional.mse_loss(h, td)

        fn = torch.compile(step, backend=N) if compiled and device == N else step
        losses = []
        for _ in range(3):
            loss = fn(x.to(device), target.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().cpu())
        results[device] = (losses, [p.detach().cpu() for p in model.parameters()])
    torch.testing.assert_close(results[N][0], results["cpu"][0], **TOL)
    # Adam divides by the root of the squared gradients: an element whose gradient is rounding noise (a compiled
    # kernel sums in another order) moves by up to lr/step either way, so the parameters get a looser bound
    torch.testing.assert_close(results[N][1], results["cpu"][1], rtol=1e-3, atol=1e-4)
    rows = torch.neuron.get_dynamo_metrics()
    assert all(r["fallback"] is None for r in rows) and sum(r["eager_nodes"] for r in rows) >= 2


@pytest.mark.parametrize("name", ["document", "alibi", "softcap"])
def test_compiled_inference_is_one_fused_kernel(name):
    """Without grad, flex_attention stays in the compiled kernel (Inductor's CPU flex template), equal to the dense
    reference."""
    score_mod, mask_mod, _ = variant(name, N)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, B, H, L, L, device=N)
    with torch.no_grad():
        out = torch.compile(flex_attention, backend=N)(*(t.to(N) for t in inputs()), score_mod=score_mod,
                                                       block_mask=block_mask)
    torch.testing.assert_close(out.cpu(), dense_reference(name)[0], **TOL)
    (row,) = torch.neuron.get_dynamo_metrics()
    assert row["eager_nodes"] == 0 and row["kernels"] == 1 and row["fallback"] is None


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bfloat16_within_its_rounding(compiled):
    _, mask_mod, _ = variant("causal", N)
    block_mask = create_block_mask(mask_mod, B, H, L, L, device=N)
    q, k, v = (t.to(N, torch.bfloat16).requires_grad_() for t in inputs())
    fn = torch.compile(flex_attention, backend=N) if compiled else flex_attention
    out = fn(q, k, v, block_mask=block_mask)
    assert out.dtype == torch.bfloat16
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(N, torch.bfloat16))
    got = [t.detach().float().cpu() for t in (out, q.grad, k.grad, v.grad)]
    torch.testing.assert_close(got, dense_reference("causal"), rtol=2e-2, atol=2e-2)
