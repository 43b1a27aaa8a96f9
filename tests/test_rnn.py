"""The RNN family on neuron (nn.LSTM runs a sequence kernel per layer and direction; GRU, RNN and the cells take
ATen's fused cells for accelerator inputs): forward and backward against the same module on the CPU, for each
configuration nn.LSTM / nn.GRU / nn.RNN accept, the cells, packed sequences, autocast and torch.compile."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import torchneuron

TOL = dict(atol=1e-5, rtol=1e-5)


def run(module: nn.Module, device: str, x: torch.Tensor, h=None, seed: int = 0):
    """Output, final state and parameter gradients of sum(output) + sum(state) on `device`."""
    m = copy.deepcopy(module).to(device)
    xd = x.detach().to(device).requires_grad_()
    torch.manual_seed(seed)  # the same dropout draws on both devices
    args = (xd,) if h is None else (xd, tuple(t.to(device) for t in h) if isinstance(h, tuple) else h.to(device))
    out, state = m(*args)
    loss = out.sum() + sum(s.sum() for s in (state if isinstance(state, tuple) else (state,)))
    loss.backward()
    grads = {n: p.grad.cpu() for n, p in m.named_parameters()}
    return out.detach().cpu(), [s.detach().cpu() for s in (state if isinstance(state, tuple) else (state,))], \
        xd.grad.cpu(), grads


def assert_same(dev, ref, **tol):
    for a, b in zip(dev[:3], ref[:3], strict=True):
        torch.testing.assert_close(a, b, **(tol or TOL))
    assert dev[3].keys() == ref[3].keys()
    for n in ref[3]:
        torch.testing.assert_close(dev[3][n], ref[3][n], **(tol or TOL), msg=lambda m, n=n: f"grad {n}: {m}")


def make(kind: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    if kind == "LSTM":
        return nn.LSTM(4, 6, **kw)
    if kind == "GRU":
        return nn.GRU(4, 6, **kw)
    return nn.RNN(4, 6, nonlinearity=kind.split("_")[1], **kw)


KINDS = ["LSTM", "GRU", "RNN_tanh", "RNN_relu"]
CONFIGS = {
    "plain": {},
    "2layer_bidir": dict(num_layers=2, bidirectional=True),
    "batch_first_nobias": dict(batch_first=True, bias=False),
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", KINDS)
def test_module_matches_cpu(kind, config):
    m = make(kind, **CONFIGS[config])
    x = torch.randn(5, 3, 4)
    assert_same(run(m, "neuron", x), run(m, "cpu", x))


def test_lstm_runs_a_kernel_per_layer_and_direction():
    """nn.LSTM runs each layer and direction's whole sequence as one kernel, forward and backward (as cuDNN and the
    CPU's oneDNN do), not a cell per time step; with oneDNN disabled it takes the cells, and both match the CPU."""
    m = make("LSTM", num_layers=2, bidirectional=True)
    x = torch.randn(5, 3, 4)
    torchneuron.clear_op_tracking()
    assert_same(run(m, "neuron", x), run(m, "cpu", x))
    ran = torchneuron.get_executed_ops()
    assert ran.get("aten::mkldnn_rnn_layer") == 4 and ran.get("aten::mkldnn_rnn_layer_backward") == 4, ran
    assert "aten::_thnn_fused_lstm_cell" not in ran and not torchneuron.get_fallback_ops()
    torchneuron.clear_op_tracking()
    with torch.backends.mkldnn.flags(enabled=False):
        assert_same(run(m, "neuron", x), run(m, "cpu", x))
    ran = torchneuron.get_executed_ops()
    assert ran.get("aten::_thnn_fused_lstm_cell") == 2 * 2 * 5 and "aten::mkldnn_rnn_layer" not in ran, ran


def test_lstm_double_backward_and_forward_ad_match_cpu():
    """The sequence kernel's backward is differentiable (PyTorch's formula for it); forward-mode AD, which it lacks
    (the CPU refuses it), takes the cells on neuron and matches the CPU's cells."""
    m = make("LSTM", num_layers=2, bidirectional=True)
    x = torch.randn(5, 3, 4)

    def double(device):
        md = copy.deepcopy(m).to(device)
        xd = x.to(device).requires_grad_()
        g, = torch.autograd.grad(md(xd)[0].pow(2).sum(), xd, create_graph=True)
        return [t.cpu() for t in (g, *torch.autograd.grad(g.pow(2).sum(), list(md.parameters())))]

    def jvp(device):
        md = copy.deepcopy(m).to(device)
        xd = x.to(device)
        return [t.cpu() for t in torch.func.jvp(lambda a: md(a)[0], (xd,), (torch.ones_like(xd),))]

    torch.testing.assert_close(double("neuron"), double("cpu"), **TOL)
    with torch.backends.mkldnn.flags(enabled=False):
        ref = jvp("cpu")
    torch.testing.assert_close(jvp("neuron"), ref, **TOL)


def test_lstm_without_grad_after_training_matches_cpu():
    """The sequence kernel keeps its backward's workspace only with grad enabled: a call under no_grad or
    inference_mode after training calls of the same shapes (queued behind other work) still returns the CPU's."""
    m = make("LSTM", num_layers=2)
    x = torch.randn(5, 3, 4)
    md = copy.deepcopy(m).to("neuron")
    xd = x.to("neuron")
    ref = m(x)[0].detach()
    for _ in range(2):
        md(xd)[0].sum().backward()
    busy = torch.randn(256, 256, device="neuron")
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with mode():
            for _ in range(3):
                busy = busy @ busy.T / 256  # keeps the stream busy: the LSTM's kernels queue behind it
                out = md(xd)[0]
        torch.testing.assert_close(out.detach().cpu(), ref, **TOL)


class Stacked(nn.Module):
    """`num_layers` one-layer RNNs with the weights of a stacked one and F.dropout between them: what the stacked
    module computes, built from pieces the other tests compare to the CPU. neuron's Philox generator draws other
    masks than the CPU's mt19937 (docs/device.md, RNG), so inter-layer dropout is checked against this."""

    def __init__(self, stacked: nn.Module):
        super().__init__()
        self.p, kind = stacked.dropout, type(stacked)
        extra = {"nonlinearity": stacked.nonlinearity} if kind is nn.RNN else {}
        self.layers = nn.ModuleList(kind(stacked.input_size if i == 0 else stacked.hidden_size, stacked.hidden_size,
                                         **extra) for i in range(stacked.num_layers))
        for i, layer in enumerate(self.layers):
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(layer, f"{name}_l0").data.copy_(getattr(stacked, f"{name}_l{i}").data)

    def forward(self, x):
        states = []
        for i, layer in enumerate(self.layers):
            x, state = layer(x)
            states.append(state)
            if i < len(self.layers) - 1:
                x = nn.functional.dropout(x, self.p, training=True)
        if isinstance(states[0], tuple):
            return x, tuple(torch.cat(s) for s in zip(*states, strict=True))
        return x, torch.cat(states)


@pytest.mark.parametrize("kind", KINDS)
def test_interlayer_dropout(kind):
    m = make(kind, num_layers=3, dropout=0.5)
    x = torch.randn(5, 3, 4)
    dev = run(m, "neuron", x)
    out, state, xgrad, grads = run(Stacked(m), "neuron", x)
    grads = {n.split(".", 2)[2].replace("_l0", f"_l{n.split('.')[1]}"): g for n, g in grads.items()}
    assert_same(dev, (out, state, xgrad, grads))  # same masks, drawn in the same order
    assert_same(dev, run(m, "neuron", x))  # reproducible for a seed
    without = run(m.eval(), "cpu", x)  # and the dropout really applied: eval mode differs
    assert not torch.allclose(dev[0], without[0])


@pytest.mark.parametrize("kind", KINDS)
def test_initial_state_and_unbatched_input(kind):
    m = make(kind, num_layers=2)
    h = torch.randn(2, 3, 6)
    h = (h, torch.randn(2, 3, 6)) if kind == "LSTM" else h
    x = torch.randn(5, 3, 4)
    assert_same(run(m, "neuron", x, h), run(m, "cpu", x, h))
    x1 = torch.randn(5, 4)  # unbatched: (seq, feature)
    assert_same(run(m, "neuron", x1), run(m, "cpu", x1))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstm_proj_size(bidirectional):
    m = make("LSTM", num_layers=2, proj_size=3, bidirectional=bidirectional)
    x = torch.randn(5, 3, 4)
    dev, ref = run(m, "neuron", x), run(m, "cpu", x)
    assert dev[0].shape[-1] == 3 * (1 + bidirectional)
    assert_same(dev, ref)


class Packed(nn.Module):
    """An RNN over a padded batch of different lengths, through pack_padded_sequence."""

    def __init__(self, rnn: nn.Module, lengths: torch.Tensor):
        super().__init__()
        self.rnn, self.lengths = rnn, lengths

    def forward(self, x):
        packed = pack_padded_sequence(x, self.lengths, batch_first=True, enforce_sorted=False)
        out, state = self.rnn(packed)
        return pad_packed_sequence(out, batch_first=True)[0], state


@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequences(kind):
    m = Packed(make(kind, batch_first=True, num_layers=2, bidirectional=True), torch.tensor([5, 2, 4]))
    x = torch.randn(3, 5, 4)
    assert_same(run(m, "neuron", x), run(m, "cpu", x))


def test_flatten_parameters_keeps_results():
    m = make("LSTM", num_layers=2)
    x = torch.randn(5, 3, 4)
    ref = run(m, "cpu", x)
    dev = m.to("neuron")
    dev.flatten_parameters()  # a no-op outside cuDNN, as on the CPU; must not fail or change anything
    assert_same(run(dev, "neuron", x), ref)


@pytest.mark.parametrize("cell", ["LSTMCell", "GRUCell", "RNNCell_tanh", "RNNCell_relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_cells_match_cpu(cell, bias):
    torch.manual_seed(0)
    name, _, act = cell.partition("_")
    m = getattr(nn, name)(4, 6, bias=bias, **({"nonlinearity": act} if act else {}))
    x, h, c = torch.randn(3, 4), torch.randn(3, 6), torch.randn(3, 6)

    def go(device):
        md = copy.deepcopy(m).to(device)
        xd = x.to(device).requires_grad_()
        state = (h.to(device), c.to(device)) if name == "LSTMCell" else h.to(device)
        out = md(xd, state)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
        return [o.detach().cpu() for o in outs] + [xd.grad.cpu()] + [p.grad.cpu() for p in md.parameters()]

    for a, b in zip(go("neuron"), go("cpu"), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_fused_cell_backward_kernels_match_autograd():
    """The CUDA-style backward kernels (for direct callers) agree with autograd through the fused forward."""
    torch.manual_seed(0)

    def leaves(*shapes):
        return [torch.randn(*s, device="neuron").requires_grad_() for s in shapes]

    ig, hg, cx, b1, b2 = inputs = leaves((3, 24), (3, 24), (3, 6), (24,), (24,))
    hy, cy, ws = torch.ops.aten._thnn_fused_lstm_cell(ig, hg, cx, b1, b2)
    ghy, gcy = torch.randn_like(hy), torch.randn_like(cy)
    auto = torch.autograd.grad((hy * ghy).sum() + (cy * gcy).sum(), inputs)
    aten = torch.ops.aten
    g_gates, g_cx, g_b = aten._thnn_fused_lstm_cell_backward_impl(ghy, gcy, cx.detach(), cy.detach(), ws.detach(), True)
    for a, b in zip((g_gates, g_gates, g_cx, g_b, g_b), auto, strict=True):
        torch.testing.assert_close(a.cpu(), b.cpu(), **TOL)

    ig, hg, hx, b1, b2 = inputs = leaves((3, 18), (3, 18), (3, 6), (18,), (18,))
    hy, ws = torch.ops.aten._thnn_fused_gru_cell(ig, hg, hx, b1, b2)
    ghy = torch.randn_like(hy)
    auto = torch.autograd.grad((hy * ghy).sum(), inputs)
    manual = torch.ops.aten._thnn_fused_gru_cell_backward(ghy, ws.detach(), True)
    for a, b in zip(manual, auto, strict=True):
        torch.testing.assert_close(a.cpu(), b.cpu(), **TOL)


@pytest.mark.parametrize("cell", ["LSTMCell", "GRUCell"])
def test_cells_double_backward_matches_cpu(cell):
    """Double backward through the cells (their ops are recorded by autograd): a gradient penalty's gradients
    match the CPU's."""
    torch.manual_seed(0)
    m = getattr(nn, cell)(4, 6)
    x, h, c = torch.randn(3, 4), torch.randn(3, 6), torch.randn(3, 6)

    def go(device):
        md = copy.deepcopy(m).to(device)
        state = (h.to(device), c.to(device)) if cell == "LSTMCell" else h.to(device)
        out = md(x.to(device), state)
        y = sum(o.square().sum() for o in (out if isinstance(out, tuple) else (out,)))
        gs = torch.autograd.grad(y, list(md.parameters()), create_graph=True)
        sum(g.square().sum() for g in gs).backward()
        return [p.grad.cpu() for p in md.parameters()]

    for a, b in zip(go("neuron"), go("cpu"), strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("cell", ["LSTMCell", "GRUCell"])
def test_torch_func_grad_through_a_cell_matches_cpu(cell):
    """torch.func transforms (per-sample gradients, as Opacus computes them) through the cells match the CPU."""
    torch.manual_seed(0)
    m0, x, h, c = getattr(nn, cell)(4, 6), torch.randn(3, 4), torch.randn(3, 6), torch.randn(3, 6)

    def go(device):
        m = copy.deepcopy(m0).to(device)
        state = (h.to(device), c.to(device)) if cell == "LSTMCell" else h.to(device)

        def loss(params, x):
            out = torch.func.functional_call(m, params, (x, state))
            return sum(o.square().sum() for o in (out if isinstance(out, tuple) else (out,)))
        grads = torch.func.grad(loss)({k: v.detach() for k, v in m.named_parameters()}, x.to(device))
        return [g.cpu() for g in grads.values()]

    for a, b in zip(go("neuron"), go("cpu"), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_inference_mode():
    m = make("GRU", num_layers=2)
    x = torch.randn(5, 3, 4)
    with torch.inference_mode():
        dev, ref = m.to("neuron")(x.to("neuron"))[0].cpu(), copy.deepcopy(m).cpu()(x)[0]
    torch.testing.assert_close(dev, ref, **TOL)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_autocast_bf16(kind):
    """Under autocast the cells compute in bfloat16 (as on CUDA, where the RNN runs in the autocast dtype)."""
    m = make(kind, num_layers=2)
    x = torch.randn(5, 3, 4)
    md = copy.deepcopy(m).to("neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16):
        out, _ = md(x.to("neuron"))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    ref, _ = m(x)
    torch.testing.assert_close(out.float().cpu(), ref.detach(), atol=3e-2, rtol=3e-2)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in md.parameters())


@pytest.mark.parametrize("allow_rnn", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compiled_matches_cpu(allow_rnn):
    """torch.compile: by default Dynamo runs RNN modules eagerly around the graph; allow_rnn traces them."""
    torch._dynamo.reset()
    m = nn.Sequential(nn.Linear(4, 4), make("LSTM", num_layers=1 + (not allow_rnn), batch_first=True))
    x = torch.randn(3, 2, 4)  # traced with allow_rnn, the graph unrolls every step: keep the sequence short
    ref = run(m, "cpu", x)
    dev = copy.deepcopy(m).to("neuron")
    with torch._dynamo.config.patch(allow_rnn=allow_rnn):
        compiled = torch.compile(dev, backend="neuron")
        xd = x.to("neuron").requires_grad_()
        out, (h, c) = compiled(xd)
        (out.sum() + h.sum() + c.sum()).backward()
    torch.testing.assert_close(out.detach().cpu(), ref[0], **TOL)
    torch.testing.assert_close(xd.grad.cpu(), ref[2], **TOL)
    for n, p in dev.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), ref[3][n], **TOL)
    torch._dynamo.reset()
