"""`torch.compile(backend="neuron")`: registration, results on the device, static shapes and recompiles,
dynamic, mode, graph breaks, compile failures and fallback, RNG, the float64 rule, default-backend routing,
debug files."""
from __future__ import annotations

import gc
import json
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from conftest import run_py

from torchneuron.compiler import backend

N = "neuron"


@pytest.fixture(autouse=True)
def _fresh(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "neuron-cache"))
    monkeypatch.delenv("TORCHNEURON_COMPILE_FALLBACK", raising=False)
    torch._dynamo.reset()
    torch.neuron.reset_dynamo_metrics()
    yield
    torch._dynamo.reset()


def rows() -> list[dict]:
    return torch.neuron.get_dynamo_metrics()


def test_entry_point_names_the_backend():
    from torch._dynamo.backends.registry import lookup_backend

    assert "neuron" in torch._dynamo.list_backends()
    assert lookup_backend("neuron") is backend.neuron_backend


def test_import_torch_stays_light():
    out = run_py("""
        import sys, torch
        print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'torchneuron.compiler.backend')
                     if m in sys.modules))
    """).stdout
    assert out.strip() == "[]"


def test_forward_and_grads_match_eager_on_neuron_memory():
    torch.manual_seed(0)
    w = torch.randn(16, 8, device=N, requires_grad=True)

    def f(x):
        return F.gelu(x @ w).softmax(-1).sum(0)

    x = torch.randn(4, 16, device=N)
    eager = f(x)
    eager.sum().backward()
    g_eager, w.grad = w.grad, None
    gc.collect()  # earlier tests' garbage freed during the compile would hide this one's allocations
    before = torch.neuron.memory_allocated()
    out = torch.compile(f, backend=N)(x)
    assert out.device == torch.device("neuron", 0)
    assert torch.neuron.memory_allocated() - before >= out.numel() * 4  # result and saved activations
    torch.testing.assert_close(out, eager)
    out.sum().backward()
    torch.testing.assert_close(w.grad, g_eager)
    ref = F.gelu(x.cpu() @ w.detach().cpu()).softmax(-1).sum(0)
    torch.testing.assert_close(out.cpu(), ref)
    (row,) = rows()
    assert row["kernels"] == 2 and row["fallback"] is None and row["nodes"] > 0 and row["compile_time_s"] > 0


def test_outputs_are_adopted_without_leaks():
    f = torch.compile(lambda x: (x * 2 + 1, x[1:]), backend=N)
    x = torch.randn(1000, device=N)
    base = torch.neuron.memory_allocated()
    y, view = f(x)
    assert torch.neuron.memory_allocated() - base == 4000  # the fresh result; the view shares x's memory
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    del y, view
    assert torch.neuron.memory_allocated() == base
    g = torch.compile(lambda x: (lambda y: (y, y[1:], y.t()))((x * 2).view(10, 100)), backend=N)
    outs = g(x)  # three results over one fresh buffer: adopted once, the others are views of it
    with torch.no_grad():
        refs = (lambda y: (y, y[1:], y.t()))((x * 2).view(10, 100))
    assert all(torch.equal(o, r) for o, r in zip(outs, refs, strict=True))
    del refs
    assert torch.neuron.memory_allocated() - base == 4000
    assert len({o.untyped_storage().data_ptr() for o in outs}) == 1
    del outs
    assert torch.neuron.memory_allocated() == base


def test_kernel_boundary_adopts_only_memory_the_results_alone_hold():
    """`_C._device_results`: fresh memory moves without a copy; memory held elsewhere is copied, never stolen."""
    from torchneuron import _C
    x = torch.arange(6.0, device=N)
    fresh, keep = torch.arange(4.0), torch.arange(3.0)
    ptr = fresh.data_ptr()
    held = keep[1:]  # `keep` (say, a constant of the kernel) also holds this memory
    outs = _C._device_results([fresh, fresh[2:], held, _C._host_alias(x)[1:], 7], [0, 0, 0, 0, None], [x])
    assert outs[0].untyped_storage().data_ptr() == ptr and outs[1].untyped_storage().data_ptr() == ptr
    assert outs[1].storage_offset() == 2 and fresh.numel() == 0  # the CPU result is left empty, not dangling
    assert torch.equal(outs[2].cpu(), torch.tensor([1.0, 2.0])) and torch.equal(keep, torch.arange(3.0))
    assert outs[2].untyped_storage().data_ptr() != keep.data_ptr()
    assert outs[3].untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and outs[3].storage_offset() == 1
    assert outs[4] == 7 and all(o.device == torch.device(N, 0) for o in outs[:4])


def test_conjugate_results_keep_their_values():
    c = torch.randn(3, 4, dtype=torch.complex64, device=N)
    out = torch.compile(lambda x: ((x * 2).conj(), (x + 1).t().conj()), backend=N)(c)
    assert torch.equal(out[0].cpu(), (c.cpu() * 2).conj()) and torch.equal(out[1].cpu(), (c.cpu() + 1).t().conj())


def test_input_mutation_reaches_device_memory():
    def f(x, buf):
        buf.add_(1)
        return x * buf

    x, buf = torch.randn(4, device=N), torch.zeros(4, device=N)
    with torch.no_grad():
        out = torch.compile(f, backend=N)(x, buf)
    assert torch.equal(buf.cpu(), torch.ones(4)) and torch.equal(out, x)



# ---- queued calls: after its first call (on the host thread), a kernel is queued on the stream like any device
# kernel, where its threads leave a core to the host (compiler/kernel.py); these tests run at one thread for that.

@pytest.fixture
def queued_kernels():
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("compiled calls are queued only when their threads leave a core to the host thread")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.needs_async
def test_a_later_call_is_queued_and_returns_before_its_work(queued_kernels):
    w = torch.randn(1024, 1024, device=N) / 32

    def chain(x):
        for _ in range(8):
            x = torch.tanh(x @ w)
        return x

    f = torch.compile(chain, backend=N)
    x = torch.randn(1024, 1024, device=N)
    first = f(x)  # on the host thread: learns where each result lives
    torch.neuron.synchronize()
    calls = [f(x) for _ in range(3)]
    assert not torch.neuron.current_stream().query(), "the compiled calls ran before their launches returned"
    for out in calls:
        assert torch.equal(out.cpu(), first.cpu())


def test_queued_calls_train_like_eager(queued_kernels):
    from torchneuron.models import GPTConfig, TinyGPT, gpt_batch

    cfg = GPTConfig(dropout=0.0)
    losses = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = TinyGPT(cfg).to(N)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fn = torch.compile(model, backend=N) if mode == "compiled" else model
        x, y = (t.to(N) for t in gpt_batch(cfg, 4, torch.Generator().manual_seed(0)))
        steps = []
        for _ in range(5):  # the first compiled step runs on the host, the others are queued
            loss = fn(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append(loss)
        losses[mode] = torch.stack(steps).cpu()
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-5, atol=1e-5)
    assert losses["eager"][-1] < losses["eager"][0]


def test_queued_calls_keep_mutations_aliases_and_order(queued_kernels):
    """Results over input memory, several results over one buffer, an input mutated in place: each call sees the
    work queued before it, and the work queued after it sees its results."""
    def f(x, buf):
        buf.add_(1)
        y = (x * buf).view(4, 8)
        return y, y.t(), y[1:], x[2:]

    g = torch.compile(f, backend=N)
    x = torch.randn(32, device=N)
    buf, ref_buf = torch.zeros(32, device=N), torch.zeros(32)
    sharing = []  # which results share memory, per call: the queued calls as the first
    with torch.no_grad():
        for i in range(4):
            x.mul_(1.5)  # eager work the call must see
            outs = g(x, buf)
            ptrs = [o.untyped_storage().data_ptr() for o in outs]
            sharing.append([[p == q for q in ptrs] for p in ptrs])
            later = outs[0] * 2  # eager work on its result
            ref_buf += 1
            xr = x.cpu()
            ref = f(xr, ref_buf.clone() - 1)
            for o, r in zip(outs, ref, strict=True):
                assert torch.equal(o.cpu(), r), i
            assert torch.equal(later.cpu(), ref[0] * 2) and torch.equal(buf.cpu(), ref_buf)
            assert outs[3].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert all(s == sharing[0] for s in sharing)


def test_queued_call_copies_memory_an_aten_kernel_allocated(queued_kernels):
    """Inductor calls ATen for ops it has no code for (a Cholesky factorisation): that result is memory the
    generated code did not allocate, copied into the result allocated at the launch."""
    a = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))
    spd = (a @ a.T + 6 * torch.eye(6)).to(N)
    f = torch.compile(lambda m, k: torch.linalg.cholesky(m * k) + 1, backend=N)
    for k in (1.0, 2.0, 3.0):
        torch.testing.assert_close(f(spd, k).cpu(), torch.linalg.cholesky(spd.cpu() * k) + 1)


@pytest.mark.needs_async
def test_results_sharing_memory_an_aten_kernel_allocated_are_queued_with_their_aliasing(queued_kernels):
    """Two results over one ATen-allocated storage (rows of a QR factor) are learnt as one fresh storage, as an op's
    results over one storage are: later calls are queued, both rows copied into one storage handed out at the
    launch, and they alias each other as at the first call and on the CPU."""
    w = torch.randn(512, 512, device=N) / 24

    def f(x, w):
        for _ in range(6):
            x = torch.tanh(x @ w)
        q, r = torch.linalg.qr(x)
        return q[0], q[1], r

    g = torch.compile(f, backend=N)
    x = torch.randn(512, 512, device=N)
    out = g(x, w)  # on the host thread: learns where each result lives
    shape = [(o.storage_offset(), o.stride()) for o in out]
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
    first = [t.cpu() for t in out]
    for o, ref in zip(first, f(x.cpu(), w.cpu()), strict=True):
        torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)
    torch.neuron.synchronize()
    calls = [g(x, w) for _ in range(3)]
    assert not torch.neuron.current_stream().query(), "the compiled calls ran before their launches returned"
    for out in calls:
        assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
        assert [(o.storage_offset(), o.stride()) for o in out] == shape
        for o, ref in zip(out, first, strict=True):
            assert torch.equal(o.cpu(), ref)


@pytest.mark.needs_async
def test_a_queued_call_over_memory_a_failed_op_never_computed_raises_and_leaves_no_garbage(queued_kernels):
    """A queued compiled call on a side stream, behind an op that fails on the worker: the op's error is raised at
    the next sync point, the call's results raise it too when read (they were never computed), and the kernel's
    later calls compute the CPU's values."""
    lib = torch.library.Library("compile_probe", "DEF")
    lib.define("fails_queued(Tensor x) -> Tensor")
    calls = []

    def fails_queued(t):
        calls.append(t)
        if len(calls) > 1:
            raise RuntimeError("fails_queued on the worker")
        return t.clone()

    lib.impl("fails_queued", fails_queued, "CPU")
    w = torch.randn(256, 256, device=N) / 16
    g = torch.compile(lambda x: torch.tanh(x @ w), backend=N)
    x = torch.randn(256, 256, device=N)
    ref = torch.tanh(x.cpu() @ w.cpu())
    g(x), g(x)  # learnt on the host, then queued
    torch.neuron.synchronize()
    side = torch.neuron.Stream()
    with torch.neuron.stream(side):
        torch.ops.compile_probe.fails_queued(x)  # its first call: on the host, succeeds
        torch.neuron.synchronize()
        m = torch.ones(1536, 1536, device=N)
        m @ m  # the next launches wait behind it, so the call below is queued before the op has failed
        y = torch.ops.compile_probe.fails_queued(x)
        out = g(y)
        with pytest.raises(RuntimeError, match="fails_queued on the worker"):
            torch.neuron.synchronize()
        with pytest.raises(RuntimeError, match="fails_queued on the worker"):
            out.cpu()
    torch.testing.assert_close(g(x).cpu(), ref, atol=1e-5, rtol=1e-5)
    del lib


def test_a_compiled_optimizer_step_keeps_its_host_step_counts(queued_kernels):
    """Adam's step counts stay on the host (not capturable) and the compiled step updates them in place: a kernel
    with host tensor arguments runs on the host thread, so they are current whenever the host reads them."""
    results = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        params = [torch.randn(16, 8, device=N, requires_grad=True) for _ in range(2)]
        opt = torch.optim.Adam(params, lr=0.1, foreach=False)
        step = torch.compile(opt.step, backend=N) if mode == "compiled" else opt.step
        counts = []
        for i in range(4):
            for p in params:
                p.grad = torch.full_like(p, 0.1 * (i + 1))
            step()
            counts.append([opt.state[p]["step"].item() for p in params])
        assert all(opt.state[p]["step"].device.type == "cpu" for p in params)
        results[mode] = ([p.detach().cpu() for p in params], counts)
    assert results["compiled"][1] == results["eager"][1] == [[float(i + 1)] * 2 for i in range(4)]
    for c, e in zip(results["compiled"][0], results["eager"][0], strict=True):
        torch.testing.assert_close(c, e)

def test_static_shapes_recompile_per_signature():
    f = torch.compile(lambda x: (x.sin() * 2).sum(-1), backend=N)
    for n in (4, 5, 6, 5):
        x = torch.randn(3, n, device=N)
        torch.testing.assert_close(f(x), (x.sin() * 2).sum(-1))
    assert [r["recompiles"] for r in rows()] == [0, 1, 2]  # the repeated shape reuses its executable
    assert len({r["name"] for r in rows()}) == 1


def test_dynamic_true_is_a_clear_error():
    with pytest.raises(Exception, match=r"(?s)dynamic=True\) is not supported.*static shapes.*dynamic=False"):
        torch.compile(lambda x: x * 3, backend=N, dynamic=True)(torch.randn(5, device=N))


def test_mode_warns_and_compiles_default():
    with pytest.warns(UserWarning, match="ignores mode=max-autotune"):
        out = torch.compile(lambda x: x - 1, backend=N, mode="max-autotune")(torch.ones(3, device=N))
    assert torch.equal(out.cpu(), torch.zeros(3))
    assert rows()[0]["ignored_options"] == ["mode=max-autotune"]


def test_fullgraph_and_graph_breaks():
    def f(x):
        y = x.cos()
        torch._dynamo.graph_break()
        return y + 1

    x = torch.randn(4, device=N)
    torch.testing.assert_close(torch.compile(f, backend=N)(x), x.cos() + 1)
    first, second = rows()
    assert "graph_break" in first["graph_break"] and second["graph_break"] is None
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(f, backend=N, fullgraph=True)(x)
    torch._dynamo.reset()
    g = torch.compile(lambda x: x.cos() + 1, backend=N, fullgraph=True)
    torch.testing.assert_close(g(x), x.cos() + 1)


@pytest.fixture
def broken_sin(monkeypatch):
    """Inductor cannot lower aten.sin (a stand-in for any host-compiler failure)."""
    from torch._inductor import lowering

    def fail(*args, **kwargs):
        raise RuntimeError("no lowering (test)")

    monkeypatch.setitem(lowering.lowerings, torch.ops.aten.sin.default, fail)


def test_compile_failure_names_graph_and_node(broken_sin):
    msg = r"(?s)could not compile graph lambda_\d+ .*node sin \(aten.sin.default\).*FALLBACK=eager"
    with pytest.raises(Exception, match=msg):
        torch.compile(lambda x: x.sin() + 1, backend=N)(torch.randn(3, device=N))
    assert rows()[0]["fallback"] is None and "sin" in rows()[0]["error"]


def test_compile_failure_eager_fallback(broken_sin, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_COMPILE_FALLBACK", "eager")
    x = torch.randn(3, device=N)
    with pytest.warns(UserWarning, match="runs eagerly on neuron"):
        out = torch.compile(lambda x: x.sin() + 1, backend=N)(x)
    torch.testing.assert_close(out, x.sin() + 1)
    assert rows()[0]["fallback"] == "eager" and "sin" in rows()[0]["error"]


def test_dropout_reproduces_eager_draws():
    def f(x):
        return F.dropout(x, 0.3, True) * 2

    x = torch.randn(16, 16, device=N, requires_grad=True)
    torch.manual_seed(1)
    eager = f(x)
    eager.sum().backward()
    g_eager, x.grad = x.grad, None
    cf = torch.compile(f, backend=N)
    torch.manual_seed(1)
    out = cf(x)
    out.sum().backward()
    assert torch.equal(out, eager) and torch.equal(x.grad, g_eager)
    assert not torch.equal(cf(x), out)  # fresh draws on the next call
    assert rows()[0]["rng_draws"] == 1 and rows()[0]["eager_nodes"] == 0


def test_value_dependent_random_op_runs_between_kernels():
    def f(x):
        p = x.sigmoid()
        return torch.bernoulli(p) * p + 1

    x = torch.randn(64, device=N)
    torch.manual_seed(3)
    eager = f(x)
    torch.manual_seed(3)
    assert torch.equal(torch.compile(f, backend=N)(x), eager)
    assert rows()[0]["eager_nodes"] == 1 and rows()[0]["kernels"] == 2


def test_attention_bias_gradient_enters_the_backward_kernel_as_compiled():
    """A learnt attention bias (T5's relative positions): the fused attention backward runs between kernels, and
    its bias gradient (last dimension 8: the meta kernel pads it to 16) enters the next kernel in the layout the
    kernel was compiled for."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 8) for _ in range(3))
    bias = torch.randn(2, 4, 8, 8)

    def f(q, k, v, bias):
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=bias * 2) * 3).sum()

    grads = {}
    for device, fn in (("cpu", f), (N, torch.compile(f, backend=N))):
        args = [t.to(device).detach().requires_grad_() for t in (q, k, v, bias)]
        fn(*args).backward()
        grads[device] = [a.grad.cpu() for a in args]
    torch.testing.assert_close(grads[N], grads["cpu"], rtol=1e-4, atol=1e-5)
    assert any(r["eager_nodes"] for r in rows())  # the attention ran as its device kernel between kernels


def test_eager_results_leave_in_their_traced_layout():
    """Whatever layout a device op between kernels gives its result, the next kernel gets the traced one."""
    import torch.fx as fx

    from torchneuron.compiler import partition

    g = fx.Graph()
    y = g.call_function(torch.ops.aten.clone.default, (g.placeholder("x"),))
    g.output((y,))
    y.meta["val"] = torch.empty_strided((4, 6), (1, 4), device="meta")  # traced column-major; clone gives rows
    x = torch.randn(4, 6, device=N)
    (out,) = partition.EagerModule(fx.GraphModule({}, g))(x)
    assert out.stride() == (1, 4) and out.device == x.device and torch.equal(out.cpu(), x.cpu())


def test_float64_follows_the_dtype_policy():
    import torchneuron

    def f(x):
        return (x * 1.1).exp() / 3

    x = torch.randn(5, dtype=torch.float64, device=N)
    with pytest.warns(UserWarning, match="float64"):
        out = torch.compile(f, backend=N)(x)
    # rounded to float32 precision after each op, like eager: every value a float32, within one float32 ulp of
    # eager's (a compiled kernel's exp may round an ulp apart from ATen's: docs/device.md)
    assert torch.equal(out.cpu(), out.cpu().float().double())
    torch.testing.assert_close(out.cpu(), f(x).cpu(), rtol=2 ** -22, atol=0)
    assert rows()[0]["float64_rounded"] == 3
    torchneuron.set_policies(dtype_policy="host")
    torch._dynamo.reset()
    out = torch.compile(f, backend=N)(x)
    torch.testing.assert_close(out.cpu(), f(x.cpu()), rtol=1e-15, atol=0)


def test_plain_torch_compile_routes_neuron_graphs():
    x = torch.randn(8, device=N)
    torch.testing.assert_close(torch.compile(lambda x: x.tanh() * 2)(x), x.tanh() * 2)
    assert len(rows()) == 1
    torch.compile(lambda x: x.tanh() * 3)(torch.randn(8))  # CPU graphs still go to Inductor
    assert len(rows()) == 1


def test_debug_dir_keeps_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_DEBUG_DIR", str(tmp_path))
    w = torch.randn(4, 4, device=N, requires_grad=True)
    torch.compile(lambda x: (x @ w).relu().sum(), backend=N, options={"model_name": "tiny"})(
        torch.randn(2, 4, device=N)).backward()
    (d,) = tmp_path.iterdir()
    assert d.name.startswith("tiny_")
    files = {p.name for p in d.iterdir()}
    for stage in ("forward", "backward"):
        assert {f"{stage}.before.fx.txt", f"{stage}.after.fx.txt", f"{stage}.partition.json",
                f"{stage}.kernel0.py"} <= files
    assert "dynamo.fx.txt" in files
    report = json.loads((d / "forward.partition.json").read_text())
    assert report["engines"]["tensor"] >= 1 and report["kernels"][0]["index"] == 0
    assert "def call(" in (d / "forward.kernel0.py").read_text()


def test_bad_fallback_value_is_rejected(monkeypatch):
    monkeypatch.setenv("TORCHNEURON_COMPILE_FALLBACK", "sometimes")
    with pytest.raises(Exception, match="TORCHNEURON_COMPILE_FALLBACK='sometimes': choose one of error, eager"):
        torch.compile(lambda x: x + 1, backend=N)(torch.ones(2, device=N))


def test_metrics_reset():
    torch.compile(lambda x: x * 5, backend=N)(torch.ones(2, device=N))
    assert len(rows()) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.neuron.reset_dynamo_metrics()
    assert rows() == []


def test_graphs_without_tensor_inputs():
    """A graph that only makes tensors (no inputs) or reads only Python scalars compiles, as on Inductor for the
    CPU (it used to fail in lift_constants)."""
    f = torch.compile(lambda: torch.tensor([1.0, 2.0], device="neuron") * 2, backend="neuron", fullgraph=True)
    out = f()
    assert out.device.type == "neuron" and torch.equal(out.cpu(), torch.tensor([2.0, 4.0]))
    g = torch.compile(lambda n: torch.arange(n, device="neuron") * 3, backend="neuron", fullgraph=True)
    for n in (3, 4, 5):  # after the second size Dynamo passes n as a SymInt: the graph's only input
        assert g(n).cpu().tolist() == [3 * i for i in range(n)]
    h = torch.compile(lambda s: torch.ones(2, device="neuron") * s + s, backend="neuron", fullgraph=True)
    for s in (1.5, 2.5):  # a float: a constant, or a scalar input after a change
        torch.testing.assert_close(h(s).cpu(), torch.full((2,), 2 * s))
    assert all(r["error"] is None and r["fallback"] is None for r in rows())
