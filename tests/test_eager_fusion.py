"""Adaptive eager fusion (compiler/eager_fusion.py) on CPU tensors: a group of aten ops compiled into one kernel
matches the ops run one by one, writes only the buffers it is given, is cached by its whole signature, is
deterministic, and refuses what it cannot fuse (counted). Each Inductor compile costs seconds: groups are shared."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch

from torchneuron import _C
from torchneuron.compiler import eager_fusion as ef
from torchneuron.compiler import inductor
from torchneuron.compiler.eager_fusion import Input, Node, Spec, Value, compile_group, fusable, stats
from torchneuron.hardware import config
from torchneuron.runtime import patches
from torchneuron.runtime.optable import TABLE

aten = torch.ops.aten
needs_async = pytest.mark.needs_async  # fuses what is queued: under launch blocking nothing is
D = 64
# bias + GELU + residual add + layer norm, as eager PyTorch runs it (what a transformer block's MLP output does)
CHAIN = (Node("aten::add.Tensor", (Input(0), Input(1))), Node("aten::gelu", (Value(0),), (("approximate", "none"),)),
         Node("aten::add.Tensor", (Value(1), Input(2))),
         Node("aten::native_layer_norm", (Value(2), [D], Input(3), Input(4), 1e-5)))
ALL = (Value(3, 0), Value(3, 1), Value(3, 2))  # layer norm's output, mean and rstd


def chain_inputs(dtype: torch.dtype, shape: tuple = (4, 8, D)) -> list[torch.Tensor]:
    """Random inputs; the activation is non-contiguous (a permuted tensor), the residual a strided slice."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape[::-1], generator=g).to(dtype).permute(2, 1, 0)
    bias = torch.randn(D, generator=g).to(dtype)
    residual = torch.randn(*shape[:-1], 2 * D, generator=g).to(dtype)[..., ::2]
    weight, ln_bias = torch.randn(D, generator=g).to(dtype), torch.randn(D, generator=g).to(dtype)
    return [x, bias, residual, weight, ln_bias]


def specs(tensors: list[torch.Tensor]) -> tuple[Spec, ...]:
    return tuple(Spec(tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def unfused(x: torch.Tensor, b: torch.Tensor, r: torch.Tensor, w: torch.Tensor, lb: torch.Tensor) -> tuple:
    return aten.native_layer_norm(aten.add.Tensor(aten.gelu(aten.add.Tensor(x, b)), r), [D], w, lb, 1e-5)


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHNEURON_CACHE_DIR", str(tmp_path_factory.mktemp("fusion-cache")))
        yield


@pytest.fixture(autouse=True)
def own_compiles():
    """Each test starts and ends with no fusion compile pending: one test's hot group never compiles in the next."""
    ef.wait_compiles()
    yield
    torch.neuron.synchronize()
    ef.wait_compiles()


def test_a_chain_matches_the_unfused_ops_and_stores_into_the_given_buffers():
    for dtype in (torch.float32, torch.bfloat16):
        ins = chain_inputs(dtype)
        assert not ins[0].is_contiguous() and not ins[2].is_contiguous()
        kernel = compile_group(CHAIN, specs(ins), ALL)
        assert kernel is not None, stats().last_failure
        assert kernel.source.count("cpp_fused_") == 2, "one kernel: the function and its one call"
        ref = unfused(*ins)
        outs = [torch.empty_strided(r.shape, r.stride(), dtype=r.dtype) for r in ref]
        assert specs(outs) == kernel.out_specs  # the buffers the unfused ops would have produced
        ptrs = [o.data_ptr() for o in outs]
        before = [t.clone() for t in ins]
        runs = stats().runs
        assert kernel(ins, outs) is None
        assert [o.data_ptr() for o in outs] == ptrs and stats().runs == runs + 1
        for o, r in zip(outs, ref, strict=True):
            torch.testing.assert_close(o, r)  # OpInfo's default tolerances for the dtype
        assert all(torch.equal(a, b) for a, b in zip(ins, before, strict=True)), "inputs are only read"


def test_only_the_requested_outputs_are_written():
    """Ask for the layer norm's output and the GELU in the middle: two stores, into exactly the given memory."""
    ins = chain_inputs(torch.float32)
    kernel = compile_group(CHAIN, specs(ins), (Value(1), Value(3, 0)))
    ref_gelu, ref_ln = aten.gelu(aten.add.Tensor(ins[0], ins[1])), unfused(*ins)[0]
    n = ref_ln.numel()
    arena = torch.full((2 * n + 3,), float("nan"))  # guard elements around and between the two buffers
    gelu_out = arena[1:n + 1].as_strided(ref_gelu.shape, ref_gelu.stride())
    ln_out = arena[n + 2:2 * n + 2].view(ref_ln.shape)
    kernel(ins, [gelu_out, ln_out])
    torch.testing.assert_close(gelu_out, ref_gelu)
    torch.testing.assert_close(ln_out, ref_ln)
    assert arena[[0, n + 1, 2 * n + 2]].isnan().all(), "nothing written outside the buffers"


def test_the_cache_is_keyed_by_the_whole_signature():
    ins = chain_inputs(torch.float32)
    first = compile_group(CHAIN, specs(ins), ALL)
    hits = stats().cache_hits
    assert compile_group(CHAIN, specs(ins), ALL) is first and stats().cache_hits == hits + 1
    as_lists = tuple(Spec(list(s.sizes), list(s.strides), s.dtype) for s in specs(ins))  # what C++ may build
    tuple_dims = (*CHAIN[:3], replace(CHAIN[3], args=(Value(2), (D,), Input(3), Input(4), 1e-5)))
    assert compile_group(tuple_dims, as_lists, ALL) is first
    assert compile_group(CHAIN, specs(chain_inputs(torch.bfloat16)), ALL) is not first
    other = compile_group(CHAIN, specs(ins), (Value(1), Value(3, 0)))  # other outputs (compiled above)
    assert other is not None and other is not first
    small = compile_group(CHAIN, specs(chain_inputs(torch.float32, (2, 3, D))), ALL)
    assert small not in (None, first, other)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)  # Inductor splits its loops for the thread count
    try:
        assert compile_group(CHAIN, specs(chain_inputs(torch.float32, (2, 3, D))), ALL) not in (None, small)
    finally:
        torch.set_num_threads(threads)


def test_constants_are_keyed_with_their_type():
    """`x + 2` keeps an int tensor's dtype, `x + 2.0` promotes it: equal as Python keys, not as groups."""
    x = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    by_int = compile_group((Node("aten::add.Tensor", (Input(0), 2)),), specs([x]), (Value(0),))
    by_float = compile_group((Node("aten::add.Tensor", (Input(0), 2.0)),), specs([x]), (Value(0),))
    assert by_int.out_specs[0].dtype == torch.int32 and by_float.out_specs[0].dtype == torch.float32
    for kernel, ref in ((by_int, x + 2), (by_float, x + 2.0)):
        out = torch.empty_like(ref)
        kernel([x], [out])
        assert torch.equal(out, ref)


def test_a_group_can_wait_until_it_recurs():
    x = torch.arange(6, dtype=torch.int32)
    group = ((Node("aten::mul.Tensor", (Input(0), 3)),), specs([x]), (Value(0),))
    cold, compiled = stats().cold, stats().compiled
    assert compile_group(*group, after=2) is None and stats().cold == cold + 1 and stats().compiled == compiled
    kernel = compile_group(*group, after=2)
    assert kernel is not None and stats().compiled == compiled + 1
    assert compile_group(*group, after=5) is kernel  # compiled once: no more waiting
    out = torch.empty_like(x)
    kernel([x], [out])
    assert torch.equal(out, x * 3)


def test_runs_and_recompiles_are_bit_identical(tmp_path, monkeypatch):
    ins = chain_inputs(torch.float32)
    kernel = compile_group(CHAIN, specs(ins), ALL)
    a, b = ([torch.empty_strided(s.sizes, s.strides, dtype=s.dtype) for s in kernel.out_specs] for _ in range(2))
    kernel(ins, a)
    kernel(ins, b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # the same group compiled again from nothing (no in-memory or on-disk entry) is the same code
    small = specs(chain_inputs(torch.float32, (2, 3, D)))
    source = compile_group(CHAIN, small, ALL).source
    monkeypatch.setattr(ef, "_CACHE", {})
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", str(tmp_path))
    compiled = stats().compiled
    again = compile_group(CHAIN, small, ALL)
    assert stats().compiled == compiled + 1 and again.source == source


def test_what_cannot_be_fused_returns_none_and_is_counted():
    x = torch.randn(4, 4)
    before = stats()
    assert compile_group((Node("aten::mm", (Input(0), Input(0))),), specs([x]), (Value(0),)) is None
    assert "aten::mm is not fusable" in stats().last_failure
    assert compile_group((Node("aten::add.Tensor", (Input(0), torch.ones(()))),), specs([x]), (Value(0),)) is None
    assert "tensor constant" in stats().last_failure
    assert compile_group((Node("aten::relu", (Value(3),)),), specs([x]), (Value(0),)) is None  # no node 3 yet
    assert compile_group((Node("aten::relu", (Input(1),)),), specs([x]), (Value(0),)) is None  # no input 1
    assert stats().failures == before.failures + 4 and stats().compiled == before.compiled
    hits = stats().cache_hits
    assert compile_group((Node("aten::mm", (Input(0), Input(0))),), specs([x]), (Value(0),)) is None
    assert stats().failures == before.failures + 4 and stats().cache_hits == hits + 1, "a failure is remembered"


def test_the_off_switches(monkeypatch):
    x = torch.randn(4, 4)
    group = ((Node("aten::relu", (Input(0),)),), specs([x]), (Value(0),))
    disabled = stats().disabled
    torch.use_deterministic_algorithms(True)
    try:
        assert not ef.enabled() and compile_group(*group) is None
    finally:
        torch.use_deterministic_algorithms(False)
    cfg = config.current_or_none()
    monkeypatch.setattr(config, "current_or_none", lambda: replace(cfg, eager_fusion=False))  # EAGER_FUSION=0
    assert not ef.enabled() and compile_group(*group) is None
    assert stats().disabled == disabled + 2


def test_fusable_follows_the_op_table():
    for op in ("aten::add.Tensor", "aten::gelu", "aten::native_layer_norm", "aten::where.self", "aten::sum.dim_IntList",
               "aten::_softmax", "aten::var.correction", "aten::clamp", "aten::pow.Tensor_Scalar", "aten::sigmoid",
               "aten::add_.Tensor", "aten::relu_", "aten::addcdiv_",  # in place on self: run functional, stored back
               "aten::_foreach_mul_.Scalar", "aten::_foreach_addcdiv_.ScalarList", "aten::_foreach_sqrt",
               "aten::_foreach_lerp_.Scalar", "aten::_foreach_add.List"):  # list ops: their per-tensor ops
        assert fusable(op), op
    for op in ("aten::native_dropout", "aten::bernoulli.p", "aten::rand", "aten::uniform",  # the generator's draws
               "aten::bernoulli_.float", "aten::_foreach_norm.Scalar", "aten::_foreach_pow.ScalarAndTensor",
               "aten::view", "aten::expand", "aten::transpose.int", "aten::mm", "aten::addmm", "aten::index.Tensor",
               "aten::nonzero", "aten::clone", "aten::_to_copy", "aten::embedding", "aten::copy_", "aten::zero_",
               "aten::add.out", "aten::sqrt.out", "aten::_foreach_sqrt.out",  # write memory their caller chose
               "aten::_foreach_addcdiv_.Tensor",  # a tensor of scalars: no per-tensor op
               "aten::not_an_op", "aten::linalg_qr"):
        assert not fusable(op), op
    for name, record in TABLE.items():
        if "." in name or not hasattr(torch.ops.aten, name):
            continue
        packet = getattr(torch.ops.aten, name)
        fused = [o for o in packet.overloads() if fusable(f"aten::{name}" + ("" if o == "default" else f".{o}"))]
        assert bool(fused) == record.fuse, name  # every fusing row names a real op with a functional overload
        assert not any(getattr(packet, o)._schema.is_mutable for o in fused), name
        if name.startswith("_foreach_"):  # and every fusing list op a per-tensor op of a fusing row
            assert all(TABLE[ef.per_tensor(f"aten::{name}.{o}").op.split("::")[1].split(".")[0]].fuse
                       for o in fused), name


def test_a_group_runs_on_device_memory_through_host_views():
    """What the stream worker does: neuron tensors enter as zero-copy CPU views (`_C._host_args`, the compiled
    kernels' boundary) and the results land in the neuron out buffers' memory."""
    ins = chain_inputs(torch.float32)
    kernel = compile_group(CHAIN, specs(ins), ALL)
    device = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="neuron").copy_(t) for t in ins]
    outs = [torch.empty_strided(s.sizes, s.strides, dtype=s.dtype, device="neuron") for s in kernel.out_specs]
    views = [*device, *outs]
    _C._host_args(views, list(range(len(views))))
    assert all(v.device.type == "cpu" and v.data_ptr() == t.data_ptr() for v, t in zip(views, device + outs,
                                                                                         strict=True))
    kernel(views[:len(ins)], views[len(ins):])
    for o, r in zip(outs, unfused(*ins), strict=True):
        torch.testing.assert_close(o.cpu(), r)


def test_a_fused_kernel_runs_without_the_gil():
    """A stream worker runs fused kernels while the host thread launches: the loop must not hold the GIL. Each
    compiled extension the kernel calls releases it around the loop (its binding imports PyEval_SaveThread;
    Inductor's default binding does not), whether compiled now or loaded from the compile cache."""
    x, b = torch.randn(64, 64), torch.randn(64)
    group = ((Node("aten::add.Tensor", (Input(0), Input(1))), Node("aten::sigmoid", (Value(0),))), specs([x, b]),
             (Value(1),))
    kernel = compile_group(*group)
    ef._CACHE.pop(ef._key(*group))  # compiled again: the compile cache's copy, loaded under the patch
    again = compile_group(*group)
    assert again is not kernel
    for k in (kernel, again):
        calls = [v for name, v in k.call.__globals__.items() if name.startswith("cpp_fused_")]
        assert calls
        for fn in calls:
            with open(fn.__self__.__file__, "rb") as f:
                assert b"PyEval_SaveThread" in f.read(), fn.__self__.__file__
        out = torch.empty_like(x)
        k([x, b], [out])
        torch.testing.assert_close(out, torch.sigmoid(x + b))
    assert not ef.patches.is_active(inductor.GIL_FREE_KERNELS), "the binding template is Inductor's again"


# ---- the device: stream workers fuse runs of queued ops ----

BIG = (64, 4096)  # 2^18 elements: the smallest ops the device fuses (eager_fusion.MIN_ELEMENTS)


def busy_stream() -> None:
    """Queue a long matmul so that the ops launched next wait in the queue, back to back, as a host that runs ahead
    leaves them (the worker fuses only what is already queued)."""
    m = torch.ones(1536, 1536, device="neuron")
    m @ m


def block(x: torch.Tensor, b: torch.Tensor, r: torch.Tensor, keep: list) -> torch.Tensor:
    """bias + GELU + residual + scale, on whatever device its tensors are; `keep` holds the GELU result."""
    h = torch.nn.functional.gelu(x + b)
    keep.append(h)
    return (h + r) * 0.5


def device_inputs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    cpu = [torch.randn(BIG, generator=g), torch.randn(BIG[1], generator=g), torch.randn(BIG, generator=g)]
    return cpu, [t.to("neuron") for t in cpu]


def fused_counts() -> tuple[int, int]:
    c = _C._fusion_counts()
    return c["kernels"], c["ops"]


@needs_async
def test_queued_runs_fuse_once_they_recur_and_match_the_unfused_ops():
    cpu, dev = device_inputs()
    ref_keep: list = []
    ref = block(*cpu, ref_keep)
    before = fused_counts()
    results = []
    for _ in range(ef.AFTER + 3):  # first call, sightings (the last hands the group to the compiler thread), 2 fused
        busy_stream()
        keep: list = []
        out = block(*dev, keep)
        results.append((out.cpu(), keep[0].cpu()))
        ef.wait_compiles()  # a hot group's kernel, compiled off the stream, serves the next step
    kernels, ops = fused_counts()
    assert kernels - before[0] >= 2 and ops - before[1] >= 2 * 4, "the last two runs: one kernel for the 4 ops"
    for out, h in results:
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(h, ref_keep[0])  # an intermediate Python holds is stored too
    assert torch.equal(results[-1][0], results[-2][0]), "deterministic run to run"
    assert torch.equal(results[0][0], ref), "the first sightings run unfused: bit-identical to the CPU"


@needs_async
def test_a_hot_group_compiles_off_the_stream_which_runs_it_unfused_meanwhile(monkeypatch):
    """The compile of a hot group runs on the fusion compiler thread, never on a stream worker: while it is held
    (here: until the test lets it go) the stream computes the same group unfused, and synchronizes; once the kernel
    is ready the group runs fused. Values are the CPU's throughout."""
    release, started, threads = threading.Event(), threading.Event(), []
    real = ef._compile

    def held_compile(*args, **kwargs):
        threads.append(threading.current_thread().name)
        started.set()
        release.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(ef, "_compile", held_compile)
    g = torch.Generator().manual_seed(5)
    shape = (128, 2048)  # 2^18 elements, a layout no other test's group has: this group is compiled here
    cpu = [torch.randn(shape, generator=g), torch.randn(shape[1], generator=g), torch.randn(shape, generator=g)]
    dev = [t.to("neuron") for t in cpu]
    ref = block(*cpu, [])
    before = fused_counts()
    try:
        for _ in range(ef.AFTER + 1):  # the first call, then AFTER sightings: the last hands it to the compiler
            busy_stream()
            torch.testing.assert_close(block(*dev, []).cpu(), ref)
        assert started.wait(60), "the hot group was handed to the compiler thread"
        for _ in range(2):  # the compile is held: the stream runs the group unfused and synchronizes
            busy_stream()
            torch.testing.assert_close(block(*dev, []).cpu(), ref)
        assert fused_counts() == before
    finally:
        release.set()
    ef.wait_compiles()
    busy_stream()
    torch.testing.assert_close(block(*dev, []).cpu(), ref)
    assert fused_counts()[0] > before[0]
    assert threads and set(threads) == {"torchneuron-fusion-compiler"}
    assert patches.is_active(ef.PER_THREAD_FX_TRACING), "the compiler thread's traces are its own"


@needs_async
def test_the_group_builder_runs_only_for_a_run_that_recurs_and_once_more_when_its_kernel_is_ready(monkeypatch):
    """Building a group is Python on the stream worker, holding the GIL the host thread needs (tens of milliseconds
    for list ops over an HF model's parameters; a loop syncing before `opt.step()` hands over runs that depend on how
    far the host got, and its AdamW step took 60-300 ms against the CPU's 5 ms). So the worker counts a run's
    sightings itself: runs whose shapes change never reach the builder, a recurring one does at its AFTER-th
    sighting, not at the sightings while its kernel compiles, and once more when the kernel is ready (then fused).
    Values are the CPU's throughout."""
    built: list[int] = []
    real_group, real_compile = ef._fused_group, ef._compile
    release = threading.Event()
    monkeypatch.setattr(ef, "_fused_group", lambda ops: built.append(len(ops)) or real_group(ops))
    monkeypatch.setattr(ef, "_compile", lambda *a, **k: release.wait() and real_compile(*a, **k))
    g = torch.Generator().manual_seed(9)
    for rows in range(72, 72 + ef.AFTER + 2):  # a new shape every call (layouts no other test's group has)
        cpu = [torch.randn(rows, 4096, generator=g), torch.randn(4096, generator=g),
               torch.randn(rows, 4096, generator=g)]
        busy_stream()
        torch.testing.assert_close(block(*[t.to("neuron") for t in cpu], []).cpu(), block(*cpu, []))
    assert built == [], "no run recurred"
    cpu = [torch.randn(80, 4096, generator=g), torch.randn(4096, generator=g), torch.randn(80, 4096, generator=g)]
    dev, ref = [t.to("neuron") for t in cpu], block(*cpu, [])
    before = fused_counts()
    try:
        for _ in range(1 + ef.AFTER + 3):  # the first call, AFTER sightings (built at the last), 3 while compiling
            busy_stream()
            torch.testing.assert_close(block(*dev, []).cpu(), ref)
        assert built == [4] and fused_counts() == before
    finally:
        release.set()
    ef.wait_compiles()
    busy_stream()
    torch.testing.assert_close(block(*dev, []).cpu(), ref)
    assert built == [4, 4] and fused_counts()[0] == before[0] + 1


@needs_async
def test_past_the_compile_budget_new_groups_run_unfused_and_are_counted(monkeypatch):
    """TORCHNEURON_FUSION_COMPILE_BUDGET bounds the compile work of a process: once it is spent, a new hot group is
    never compiled (counted once, remembered, reported) and runs unfused with the CPU's values, while the kernels
    compiled before keep serving."""
    cfg = config.current_or_none()
    budget = stats().compile_seconds + 1e-6  # the next compile spends it
    monkeypatch.setattr(config, "current_or_none", lambda: replace(cfg, fusion_compile_budget=budget))
    x = torch.randn(5, 7)
    first, second = (((Node("aten::mul.Tensor", (Input(0), k)),), specs([x]), (Value(0),)) for k in (5, 7))
    before = stats()
    kernel = compile_group(*first)
    assert kernel is not None and stats().compile_seconds > budget
    assert compile_group(*second) is None and stats().over_budget == before.over_budget + 1
    assert compile_group(*second) is None and stats().over_budget == before.over_budget + 1, "remembered"
    assert compile_group(*first) is kernel and stats().failures == before.failures
    # on the device: a hot group the stream worker would hand to the compiler runs unfused, exact
    g = torch.Generator().manual_seed(6)
    shape = (96, 4096)  # a layout no other test's group has
    cpu = [torch.randn(shape, generator=g), torch.randn(shape[1], generator=g), torch.randn(shape, generator=g)]
    dev = [t.to("neuron") for t in cpu]
    ref, fused, over = block(*cpu, []), fused_counts(), stats().over_budget
    for _ in range(ef.AFTER + 3):
        busy_stream()
        assert torch.equal(block(*dev, []).cpu(), ref)
        ef.wait_compiles()
    assert fused_counts() == fused and stats().over_budget > over and stats().compiled == before.compiled + 1
    from torchneuron.integrations import porting_report

    assert "the compile budget spent (raise TORCHNEURON_FUSION_COMPILE_BUDGET)" in porting_report.render_text(
        porting_report.collect())


def test_a_trace_on_another_thread_is_not_this_threads():
    """torch.fx keeps one global 'tracing' flag. While another thread traces (the fusion compiler thread does, with
    make_fx and Inductor's pattern matcher), a torch.compile'd function runs on this thread instead of raising
    'Detected that you are using FX to symbolically trace a dynamo-optimized function'; a trace on this thread
    still raises it, as in torch."""
    from torch.fx._symbolic_trace import is_fx_tracing  # a reference taken before the patch: it follows it

    patches.apply(ef.PER_THREAD_FX_TRACING)
    inside, release, traced = threading.Event(), threading.Event(), []

    class Waits(torch.nn.Module):
        def forward(self, x):
            inside.set()
            release.wait(60)
            return x + 1

    compiled = torch.compile(lambda x: x * 2, backend="eager")
    other = threading.Thread(target=lambda: traced.append(torch.fx.symbolic_trace(Waits())))
    other.start()
    try:
        assert inside.wait(60)
        assert torch.fx._symbolic_trace._is_fx_tracing_flag, "premise: the other thread set torch.fx's flag"
        assert not is_fx_tracing()
        x = torch.arange(3.0)
        assert torch.equal(compiled(x), x * 2)
    finally:
        release.set()
        other.join(60)
    assert traced and torch.equal(traced[0](torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(RuntimeError, match="symbolically trace a dynamo-optimized function"):
        torch.fx.symbolic_trace(lambda x: compiled(x))


@needs_async
def test_a_result_python_frees_is_still_stored_for_the_queued_ops_that_read_it():
    """Python may drop a result while queued kernels still read it (stream order makes that legal, as on CUDA):
    a fused run must store it. Here the clone after the run reads the GELU, freed before the worker gets there;
    the sum's temporaries are freed too, and their blocks handed out again inside the run."""
    cpu, dev = device_inputs()
    ref = torch.nn.functional.gelu(cpu[0] + cpu[1])
    before = fused_counts()
    for _ in range(ef.AFTER + 1):
        busy_stream()
        copy = torch.nn.functional.gelu(dev[0] + dev[1]).clone()  # the GELU's result: freed at once
        total = ((dev[0] * 2 + 1) * 3 + dev[2]) * 0.5  # each temporary freed, its block reused by the next op
        torch.testing.assert_close(copy.cpu(), ref)
        torch.testing.assert_close(total.cpu(), ((cpu[0] * 2 + 1) * 3 + cpu[2]) * 0.5)
        ef.wait_compiles()
    assert fused_counts()[0] > before[0]


def test_printing_deterministic_mode_and_views_end_a_fused_run(capsys):
    cpu, dev = device_inputs()
    for _ in range(ef.AFTER + 1):  # make the group hot
        busy_stream()
        block(*dev, [])
    torch.neuron.synchronize()
    ef.wait_compiles()
    before = fused_counts()
    busy_stream()
    h = torch.nn.functional.gelu(dev[0] + dev[1])
    print(h[0, :2])  # a host read: the queue drains, the ops after it start a new run
    out = (h + dev[2]) * 0.5
    torch.testing.assert_close(out.cpu(), block(*cpu, []))
    kernels, ops = fused_counts()
    assert ops - before[1] <= 2 * (kernels - before[0]), "no fused run spans the print (2 ops on each side)"
    torch.use_deterministic_algorithms(True)
    try:
        before = fused_counts()
        busy_stream()
        torch.testing.assert_close(block(*dev, []).cpu(), block(*cpu, []))
        assert fused_counts() == before
    finally:
        torch.use_deterministic_algorithms(False)
    busy_stream()
    y = dev[0] + 1
    z = y[:, ::2] * 2 + 1  # reads a view of y: the run stops there, the values stay right
    torch.testing.assert_close(z.cpu(), (cpu[0] + 1)[:, ::2] * 2 + 1)


@needs_async
def test_an_optimizer_step_becomes_one_kernel_and_tracks_the_cpus_optimizer(request):
    """AdamW's multi-tensor step (8 list ops over every parameter) queued behind work fuses once it recurs. Its
    bias corrections and step sizes change every step: they enter the kernel as lifted scalars, so one kernel
    serves every step, replayed by the worker without building the group again (no compile_group lookup). Every
    step's parameters and moments stay within tolerance of the CPU's foreach AdamW (the first sightings, unfused,
    bit for bit)."""
    g = torch.Generator().manual_seed(2)
    cpu = [torch.randn(512, 256, generator=g), torch.randn(512, generator=g), torch.randn(256, 512, generator=g)]
    dev = [p.to("neuron") for p in cpu]
    opts = [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True) for ps in (cpu, dev)]
    before = fused_counts()
    fused_from = ef.AFTER + 1  # the first call runs on the host; AFTER sightings; the kernel, compiled off the stream
    for step in range(fused_from + 4):
        grads = [torch.randn(p.shape, generator=g) for p in cpu]
        for p, q, grad in zip(cpu, dev, grads, strict=True):
            q.grad = None  # freed first, as zero_grad does: a steady loop's tensors come back at the same addresses
            p.grad, q.grad = grad, grad.to("neuron")
        if step == fused_from + 1:  # the first fused step recorded the plan: replayed from here
            lookups = stats().cache_hits + stats().cold + stats().compiled
        busy_stream()
        for opt in opts:
            opt.step()
        for p, q in zip(cpu, dev, strict=True):
            exact = step < fused_from
            torch.testing.assert_close(q.cpu(), p, rtol=0 if exact else None, atol=0 if exact else None)
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opts[1].state[q][k].cpu(), opts[0].state[p][k])
        ef.wait_compiles()
    kernels, ops = fused_counts()
    assert kernels - before[0] >= 4 and ops - before[1] >= 4 * 8, "the last steps: one kernel for the 8 list ops"
    if not request.config.getoption("--verify-replay"):  # verification rebuilds on purpose
        assert stats().cache_hits + stats().cold + stats().compiled == lookups, "replayed, not rebuilt in Python"


@needs_async
@pytest.mark.parametrize("wait", ["before the step", "in its closure"])
def test_an_optimizer_step_reaches_the_worker_whole_whether_or_not_the_host_just_waited(wait):
    """A loop that reads the loss before `opt.step()` (HF Trainer's does; Lightning's closure reads it inside the
    step) leaves the worker idle when the step's first list op is launched: unmarked, the worker took that op alone,
    then whatever the host had queued by then, so the runs it handed to fusion depended on timing, rarely recurred,
    and compiled groups that hardly ran. torch.optim's step hooks mark the step, and the worker takes it whole (after
    a sync inside it, what follows): once fused, every step runs all 8 list ops of its AdamW in one kernel, whether
    the host had just waited or ran ahead, with the CPU's values."""
    g = torch.Generator().manual_seed(12)
    cpu = [torch.randn(384, 512, generator=g), torch.randn(512, generator=g), torch.randn(512, 384, generator=g)]
    dev = [p.to("neuron") for p in cpu]
    opts = [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True) for ps in (cpu, dev)]
    fused_from, per_step = ef.AFTER + 2, []  # the first step (state made) differs: AFTER sightings from the second
    for step in range(fused_from + 4):
        for p, q in zip(cpu, dev, strict=True):
            q.grad = None
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.to("neuron")
        waited = step % 2 == 0
        if not waited:
            busy_stream()  # the host runs ahead: the step queues behind work
        elif wait == "before the step":
            torch.neuron.synchronize()  # the loss read: the worker is idle when the step begins
        before = fused_counts()
        for opt in opts:
            opt.step((lambda: dev[0].sum().item()) if waited and wait == "in its closure" else None)
        for p, q in zip(cpu, dev, strict=True):
            torch.testing.assert_close(q.cpu(), p)
        per_step.append(fused_counts()[1] - before[1])
        ef.wait_compiles()
    assert per_step[fused_from:] == [8] * 4, per_step


@needs_async
def test_a_step_that_raises_or_polls_leaves_no_launch_held():
    """A step that raises never reaches its end hook: its run stays held until something waits for it (a sync point,
    a poll of an event or stream), and each of those lets it go, so nothing hangs."""
    x = torch.arange(4.0, device="neuron", requires_grad=True)
    opt = torch.optim.SGD([x], lr=1.0)

    def closure() -> None:
        raise RuntimeError("the loss could not be computed")

    for poll in ("event", "stream", "sync"):
        busy_stream()  # the step's launches queue (an idle stream runs a small op at once)
        with pytest.raises(RuntimeError, match="the loss could not be computed"):
            opt.step(closure)
        y = x.detach() * 3  # queued inside the run the failed step left held
        if poll == "sync":
            assert torch.equal(y.cpu(), torch.arange(4.0) * 3)
            continue
        done = torch.neuron.Event()
        done.record()
        query = done.query if poll == "event" else torch.neuron.current_stream().query
        deadline = time.monotonic() + 60
        while not query() and time.monotonic() < deadline:
            pass
        assert query(), f"{poll}.query() never saw the held launches run"
        assert torch.equal(y.cpu(), torch.arange(4.0) * 3)


def test_the_step_hooks_are_active_and_trace_to_nothing_in_a_compiled_step():
    """The hooks mark eager steps only: a torch.compile'd step (Dynamo traces the global step hooks) gets no graph
    break from them."""
    assert patches.is_active(ef.OPTIMIZER_STEP_RUNS)
    begin, end = ef._mark_run(True), ef._mark_run(False)

    def step(x: torch.Tensor) -> torch.Tensor:
        begin(None, (), {})
        x = x * 2
        end(None, (), {})
        return x

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 2.0))


@needs_async
def test_in_place_ops_fuse_and_a_run_stops_where_their_memory_is_read_another_way():
    """`a.mul_(2).add_(b).relu_()` fuses, its value stored back into `a` (and a bfloat16 tensor's in-place op with
    a float operand rounds as the op does); a view of a written tensor read in the same run, or a write to a tensor
    whose view the run read, ends the run there: the values stay the CPU's."""
    cpu, dev = device_inputs()
    half = [cpu[0].bfloat16(), dev[0].bfloat16()]
    before = fused_counts()
    for _ in range(ef.AFTER + 2):
        busy_stream()
        got = []
        for x, b, r, h in ((*dev, half[1]), (*cpu, half[0])):
            a = x.clone()
            a.mul_(2).add_(b).relu_()
            hh = h.clone()
            hh.mul_(r).add_(1.5)
            c = r.clone()
            c.mul_(3)
            v = c[:, ::2] + 1  # a view of the tensor just written
            e = r.clone()
            w = e[:, 1:] * 2  # a view read, then its base written
            e.add_(1)
            got.append([t.cpu() for t in (a, hh, c, v, e, w)])
        for mine, ref in zip(*got, strict=True):
            torch.testing.assert_close(mine, ref)
        ef.wait_compiles()
    assert fused_counts()[0] > before[0]


@needs_async
def test_list_ops_take_new_numbers_every_call_and_a_changed_constant_is_not_replayed():
    """A list op's numbers (scalars, `alpha`) change from call to call: lifted, one kernel serves them all. A
    number compiled into a kernel (a plain op's `alpha`) that changes is not replayed with its old value. An
    integer list's scalar is not lifted (it would promote differently): that op runs unfused. Every call matches
    the CPU's."""
    g = torch.Generator().manual_seed(3)
    cpu = [torch.randn(BIG, generator=g), torch.randn(BIG[1], BIG[0], generator=g)]
    other = [torch.randn(t.shape, generator=g) for t in cpu]
    ints = [torch.randint(0, 9, BIG, generator=g), torch.randint(0, 9, (BIG[1], BIG[0]), generator=g)]
    dev, dev_other, dev_ints = ([t.to("neuron") for t in ts] for ts in (cpu, other, ints))
    before = fused_counts()
    for i in range(ef.AFTER + 3):
        busy_stream()
        outs = []
        for xs, ys, ns in ((dev, dev_other, dev_ints), (cpu, other, ints)):
            xs = [x.clone() for x in xs]
            ns = [n.clone() for n in ns]
            torch._foreach_mul_(xs, 1.0 + i / 7)
            torch._foreach_add_(xs, [0.5 * i, -0.25 * i])
            torch._foreach_add_(xs, ys, alpha=0.5 - i)
            sq = torch._foreach_sqrt(torch._foreach_abs(xs))
            torch._foreach_add_(ns, i)
            torch._foreach_mul_(ns, 2)
            a = xs[0] * 2
            a.add_(ys[0], alpha=0.5 if i < ef.AFTER + 1 else -2.0)  # compiled in: changed once the run is hot
            outs.append([t.cpu() for t in (*xs, *sq, *ns, a)])
        for mine, ref in zip(*outs, strict=True):
            torch.testing.assert_close(mine, ref)
        ef.wait_compiles()
    assert fused_counts()[0] - before[0] >= 2


def test_a_list_op_over_too_many_tensors_is_not_offered(monkeypatch):
    """A list op over more than MAX_LIST tensors stays unfused: the worker does not even hand it to Python (building
    its group would cost every step); its values are the CPU's."""
    handed: list = []
    monkeypatch.setattr(ef, "run_queued", lambda ops: handed.append(ops) or (0, None))
    g = torch.Generator().manual_seed(4)
    cpu = [torch.randn(256, generator=g) for _ in range(ef.MAX_LIST + 1)]  # MIN_ELEMENTS together
    dev = [t.to("neuron") for t in cpu]
    before = fused_counts()
    for _ in range(ef.AFTER + 1):
        busy_stream()
        outs = []
        for xs in (dev, cpu):
            xs = [x.clone() for x in xs]
            torch._foreach_mul_(xs, 3.0)
            torch._foreach_add_(xs, 1.0)
            outs.append([x.cpu() for x in xs])
        for mine, ref in zip(*outs, strict=True):
            assert torch.equal(mine, ref)
    assert fused_counts() == before and not handed


@needs_async
def test_list_ops_over_many_tensors_fuse_as_one_kernel_per_shape():
    """A run of list ops over more tensors than one kernel may hold (MAX_NODES nodes) is split by list position:
    positions of one shape share a kernel of at most COLUMNS positions, so the compile work follows the shapes,
    not the list length, and the whole run replays as one fused launch. While its kernels compile, the run's tail
    is not offered as a group of its own (no kernel is compiled for it). Values track the CPU's list ops."""
    g = torch.Generator().manual_seed(6)
    n = 4 * ef.COLUMNS  # two shapes, each filling two kernels' worth of positions
    cpu = [torch.randn(128, 128, generator=g) if i % 2 else torch.randn(64, 256, generator=g) for i in range(n)]
    grads = [torch.randn(t.shape, generator=g) for t in cpu]
    dev, dev_grads = [t.to("neuron") for t in cpu], [t.to("neuron") for t in grads]
    assert 4 * n > ef.MAX_NODES
    before, compiled = fused_counts(), stats().compiled
    for i in range(ef.AFTER + 3):
        busy_stream()
        outs = []
        for xs, gs in ((dev, dev_grads), (cpu, grads)):
            xs = [x.clone() for x in xs]
            torch._foreach_mul_(xs, 1.0 - 0.01 * i)  # a number that changes every step: lifted, not compiled in
            torch._foreach_add_(xs, gs, alpha=0.5)
            r = torch._foreach_sqrt(torch._foreach_abs(xs))
            outs.append([t.cpu() for t in (*xs, *r)])
        for mine, ref in zip(*outs, strict=True):
            torch.testing.assert_close(mine, ref)
        ef.wait_compiles()
    kernels, ops = fused_counts()
    assert kernels - before[0] >= 2 and ops - before[1] >= 2 * 4, "the last steps: one fused launch of 4 list ops"
    assert stats().compiled - compiled == 2, "a kernel per shape (and none for a tail of the run)"


def _neighbour_written_after(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
    torch._foreach_mul_(xs, 2.0)
    torch._foreach_add_(xs[1:], xs[:-1])  # position i reads what position i of mul_ wrote, and writes i + 1's


def _neighbour_written_before(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
    torch._foreach_add_(ys[:-1], xs[1:])  # position i reads tensor i + 1 ...
    torch._foreach_mul_(xs[::-1], 2.0)  # ... which position n - 2 - i writes: an earlier position for half of them


@needs_async
@pytest.mark.parametrize("step", [_neighbour_written_after, _neighbour_written_before])
def test_list_positions_that_depend_on_each_other_are_not_split(monkeypatch, step):
    """When one list position reads what another writes, the positions cannot run one after another: the run is
    not split, the group stops at MAX_NODES nodes, and the values stay exact."""
    splits: list = []
    split = ef._split
    monkeypatch.setattr(ef, "_split", lambda *a: splits.append(split(*a)) or splits[-1])
    g = torch.Generator().manual_seed(7)
    n = ef.MAX_NODES + 16  # each list op over MIN_ELEMENTS
    cpu = [torch.randn(64, 64, generator=g) for _ in range(2 * n)]
    dev = [t.to("neuron") for t in cpu]
    for _ in range(ef.AFTER + 2):
        busy_stream()
        outs = []
        for ts in (dev, cpu):
            ts = [t.clone() for t in ts]
            step(ts[:n], ts[n:])
            outs.append([t.cpu() for t in ts])
        for mine, ref in zip(*outs, strict=True):
            assert torch.equal(mine, ref)
        ef.wait_compiles()
    assert splits and all(s is None for s in splits)


def test_the_porting_report_counts_fused_kernels():
    from torchneuron.integrations import porting_report

    r = porting_report.collect()
    st = stats()
    assert r["eager_fusion"] == {**dict(zip(("kernels", "ops"), fused_counts(), strict=True)),
                                 "cold": _C._fusion_counts()["cold"],
                                 "compiled": st.compiled, "compile_seconds": round(st.compile_seconds, 3),
                                 "failures": st.failures, "over_budget": st.over_budget,
                                 "last_failure": st.last_failure}
    assert f"eager fusion: {r['eager_fusion']['kernels']} fused kernels" in porting_report.render_text(r)


def test_fusion_off_installs_nothing():
    """TORCHNEURON_EAGER_FUSION=0: the stream workers are never handed fusion (no GIL taken, nothing counted), and
    the same recurring run that fuses above stays unfused and exact."""
    code = """
import torch
from torchneuron import _C
from torchneuron.compiler import eager_fusion as ef
x, b = torch.randn(64, 4096), torch.randn(4096)
xd, bd = x.to("neuron"), b.to("neuron")
for _ in range(ef.AFTER + 2):
    m = torch.ones(1536, 1536, device="neuron"); m @ m
    out = torch.nn.functional.gelu(xd + bd) * 0.5
    assert torch.equal(out.cpu(), torch.nn.functional.gelu(x + b) * 0.5)
assert _C._fusion_counts() == {"kernels": 0, "ops": 0, "cold": 0}, _C._fusion_counts()
assert ef.stats() == ef.Stats(), ef.stats()
print("ok")
"""
    env = {**os.environ, "TORCHNEURON_EAGER_FUSION": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
