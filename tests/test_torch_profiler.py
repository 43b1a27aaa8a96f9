"""torch.profiler with ProfilerActivity.PrivateUse1: every kernel the neuron device executes is a device event
with its modelled device time (the cost model's), linked to the host op that launched it."""
from __future__ import annotations

import itertools
import json
import re
from collections import Counter

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule, supported_activities, tensorboard_trace_handler

import torchneuron
from torchneuron import _C
from torchneuron.costmodel.ops import T, op_cost
from torchneuron.profiler.trace import _default_target

ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]


def device_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == DeviceType.PrivateUse1]


def executed_kernels() -> Counter:
    """What the device counted as run since clear_op_tracking (native and host-fallback ops), by kernel name."""
    ops = Counter(torchneuron.get_executed_ops()) + Counter(torchneuron.get_fallback_ops())
    return Counter({"neuron::" + name.removeprefix("aten::"): n for name, n in ops.items()})


def modelled_us(op: str, ins: list[T], outs: list[T]) -> float:
    return op_cost(op, ins, outs, _default_target(), mode="eager").time_s * 1e6


def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w).sum()


def test_activity_is_supported_and_idle_when_not_profiling():
    assert ProfilerActivity.PrivateUse1 in supported_activities()
    assert _C._profiler_registered()
    assert not _C._tracing_device()


def test_eager_kernels_are_device_events_with_modelled_time():
    x, w = torch.randn(64, 32, device="neuron"), torch.randn(32, 48, device="neuron")
    torchneuron.clear_op_tracking()
    with profile(activities=ACTIVITIES) as prof:
        step(x, w)
    assert not _C._tracing_device()
    events = device_events(prof)
    assert Counter(e.name for e in events) == executed_kernels()
    assert {e.name for e in events} == {"neuron::mm", "neuron::relu", "neuron::sum"}
    f32 = "float32"
    expected = {"neuron::mm": modelled_us("mm", [T((64, 32), f32), T((32, 48), f32)], [T((64, 48), f32)]),
                "neuron::relu": modelled_us("relu", [T((64, 48), f32)], [T((64, 48), f32)]),
                "neuron::sum": modelled_us("sum", [T((64, 48), f32)], [T((), f32)])}
    for e in events:
        assert e.device_index == 0
        assert e.time_range.elapsed_us() == pytest.approx(expected[e.name], abs=2e-3)
    # each kernel is linked to its host op: key_averages adds its time to that op's device time
    rows = {r.key: r for r in prof.key_averages()}
    assert rows["aten::mm"].device_time_total == pytest.approx(expected["neuron::mm"], abs=2e-3)
    assert rows["aten::relu"].device_time_total == pytest.approx(expected["neuron::relu"], abs=2e-3)
    assert rows["neuron::mm"].self_device_time_total == pytest.approx(expected["neuron::mm"], abs=2e-3)
    total = sum(r.self_device_time_total for r in prof.key_averages() if r.key.startswith("neuron::"))
    assert total == pytest.approx(sum(expected.values()), abs=5e-3) and total > 0
    table = prof.key_averages().table(sort_by="device_time_total")
    assert "Self NEURON" in table and "neuron::mm" in table
    # one queue per device: kernels do not overlap
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    assert all(b[0] >= a[1] - 1e-3 for a, b in itertools.pairwise(spans))


def test_chrome_trace_has_the_device_track(tmp_path):
    x, w = torch.randn(64, 32, device="neuron"), torch.randn(32, 48, device="neuron")
    with profile(activities=ACTIVITIES) as prof:
        step(x, w)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    doc = json.loads(path.read_text())  # valid JSON, the object form Perfetto and chrome://tracing load
    evs = doc["traceEvents"]
    kernels = [e for e in evs if e.get("cat") == "kernel"]
    assert sorted(e["name"] for e in kernels) == ["neuron::mm", "neuron::relu", "neuron::sum"]
    assert all(e["ph"] == "X" and e["pid"] == 0 and e["dur"] > 0 for e in kernels)
    names = {(e["pid"], e["args"]["name"]) for e in evs if e.get("ph") == "M" and e["name"] == "process_name"}
    assert (0, "neuron 0") in names
    rows = {e["args"]["name"] for e in evs if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == 0}
    assert {"tensor engine", "scalar engine", "vector engine"} <= rows
    ops = {e["args"]["External id"]: e["name"] for e in evs if e.get("cat") == "cpu_op"}
    assert {e["name"]: ops[e["args"]["External id"]] for e in kernels} == {
        "neuron::mm": "aten::mm", "neuron::relu": "aten::relu", "neuron::sum": "aten::sum"}


def test_schedule_and_tensorboard_handler(tmp_path):
    x, w = torch.randn(16, 16, device="neuron"), torch.randn(16, 16, device="neuron")
    with profile(activities=ACTIVITIES, schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(tmp_path))) as prof:
        for _ in range(5):
            step(x, w)
            prof.step()
    (trace,) = tmp_path.glob("*.pt.trace.json")
    kernels = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    assert Counter(e["name"] for e in kernels) == {"neuron::mm": 2, "neuron::relu": 2, "neuron::sum": 2}


def test_compiled_kernels_are_device_events():
    def f(x, w):
        y = torch.relu(x @ w) * 2
        torch._dynamo.graph_break()
        return y + 1

    g = torch.compile(f, backend="neuron")
    x, w = torch.randn(256, 256, device="neuron"), torch.randn(256, 256, device="neuron")
    g(x, w)
    torchneuron.clear_op_tracking()
    with profile(activities=ACTIVITIES) as prof:
        out = g(x, w)
    assert torch.allclose(out.cpu(), f(x.cpu(), w.cpu()))
    events = device_events(prof)
    compiled = [e for e in events if "kernel" in e.name]
    names = [e.name for e in compiled]  # one kernel per graph, on each side of the break
    # Dynamo numbers graphs per process (f_0, f_1, ... after earlier compiles of a function named f)
    assert re.fullmatch(r"neuron::f_\d+_inference_kernel0", names[0]), names
    assert names[1].startswith("neuron::torch_dynamo_resume_in_f")
    assert len(names) == 2
    eager = Counter(e.name for e in events if "kernel" not in e.name)
    assert eager == executed_kernels()  # anything Dynamo ran eagerly between the graphs
    t = _default_target()
    assert all(e.time_range.elapsed_us() >= t.launch_s * 1e6 for e in compiled)  # at least one launch each
    assert compiled[0].time_range.elapsed_us() > compiled[1].time_range.elapsed_us()  # the matmul's graph
    rows = {r.key: r for r in prof.key_averages()}
    for e in compiled:  # the host op of a kernel is a record_function scope named after it
        host = rows[e.name.removeprefix("neuron::")]
        assert host.device_time_total == pytest.approx(e.time_range.elapsed_us(), abs=2e-3)


def test_explicit_kernels_and_copies_are_device_events():
    img, k = torch.randn(1, 3, 16, 16, device="neuron"), torch.randn(4, 3, 3, 3, device="neuron")
    host = torch.randn(256, 256)
    with profile(activities=ACTIVITIES) as prof:
        torch.nn.functional.conv2d(img, k)
        host.to("neuron")
    names = Counter(e.name for e in device_events(prof))
    assert names["neuron::convolution"] == 1 and names["neuron::copy_"] == 1
    (copy,) = [e for e in device_events(prof) if e.name == "neuron::copy_"]
    f32 = T((256, 256), "float32")
    assert copy.time_range.elapsed_us() == pytest.approx(modelled_us("copy", [f32], [f32]), abs=2e-3)


def test_a_kernel_the_cost_model_cannot_price_keeps_its_event(monkeypatch):
    import torchneuron.profiler.kineto as kineto

    real = kineto.op_cost

    def flaky(op, *args, **kwargs):
        if op == "neuron::relu":
            raise ValueError("no rule")
        return real(op, *args, **kwargs)

    monkeypatch.setattr(kineto, "op_cost", flaky)
    x, w = torch.randn(64, 32, device="neuron"), torch.randn(32, 48, device="neuron")
    with pytest.warns(UserWarning, match="could not price 1 kernel kind"), profile(activities=ACTIVITIES) as prof:
        step(x, w)
    times = {e.name: e.time_range.elapsed_us() for e in device_events(prof)}
    assert times["neuron::relu"] == 0 and times["neuron::mm"] > 0 and times["neuron::sum"] > 0
