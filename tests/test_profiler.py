"""torchneuron.profiler: ops on neuron tensors with host and modelled device times, a Chrome / Perfetto trace,
and a summary table."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

import torchneuron
from torchneuron.costmodel.ops import target
from torchneuron.profiler import profile
from torchneuron.profiler.trace import kernel_cost

TRACE_KEYS = {"name", "ph", "ts", "dur", "pid", "tid"}


def _check_trace(doc: dict) -> list[dict]:
    """The JSON object form of the Chrome trace-event format that Perfetto imports."""
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert TRACE_KEYS <= set(e), e
        assert e["ph"] in ("X", "M")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["ts"] >= 0 and e["dur"] >= 0
    return [e for e in events if e["ph"] == "X"]


def test_neuron_ops_are_recorded_with_modelled_device_time(tmp_path):
    lin = torch.nn.Linear(64, 128).to("neuron")
    x = torch.randn(32, 64, device="neuron")
    host_only = torch.randn(8)
    with torchneuron.profiler.profile(target="trn2") as prof:
        y = torch.nn.functional.gelu(lin(x)).sum()
        host_only * 2  # a CPU op: not recorded
    assert y.device.type == "neuron"
    names = [e.name for e in prof.events]
    assert "aten::addmm" in names and "aten::gelu" in names and "aten::mul" not in names
    mm = next(e for e in prof.events if e.name == "aten::addmm")
    assert mm.device == "neuron:0" and mm.cost.engine == "tensor" and mm.host_ns > 0
    assert mm.cost.flops == 2 * 32 * 64 * 128
    # one device queue: each op starts after the previous one ends
    timed = [e for e in prof.events if e.device_s > 0]
    assert all(b.device_start_s >= a.device_start_s + a.device_s - 1e-12 for a, b in itertools.pairwise(timed))

    path = prof.export_chrome_trace(tmp_path / "trace.json")
    spans = _check_trace(json.loads(path.read_text()))
    device = [e for e in spans if e["pid"] >= 2]
    assert {e["name"] for e in device} >= {"aten::addmm", "aten::gelu"}
    assert {"bound", "achieved", "flops", "bytes"} <= set(device[0]["args"])


def test_a_metadata_question_costs_no_device_time():
    """`p.data = t` (and every `Module.to`) asks `aten::_has_compatible_shallow_copy_type`, which reads only the two
    tensors' metadata: it was priced as a host op (33 us each, 17% of a small training step's modelled time, and
    --from-profile priced it on both sides)."""
    p = torch.nn.Parameter(torch.randn(64, 64, device="neuron"))
    t = torch.randn(64, 64, device="neuron")
    with torchneuron.profiler.profile(target="trn2") as prof:
        p.data = t
        t * 2
    times = {e.name: e.device_s for e in prof.events}
    assert times["aten::_has_compatible_shallow_copy_type"] == 0.0 and times["aten::mul"] > 0


def test_cpu_profiling_and_summary_table():
    a = torch.randn(256, 256)
    with profile(device="cpu", target="trn1") as prof:
        b = torch.relu(a @ a)
        b.sum()
    rows = {r["op"]: r for r in prof.table()}
    assert rows["aten::mm"]["engine"] == "tensor" and rows["aten::mm"]["calls"] == 1
    assert rows["aten::relu"]["engine"] == "scalar"
    assert rows["aten::sum"]["engine"] == "vector"
    tot = prof.totals()
    assert tot["device_s"] == pytest.approx(sum(r["device_s"] for r in rows.values()))
    text = prof.summary()
    assert "modelled trn1 device" in text
    for col in ("op", "calls", "host ms", "device ms", "engine", "bound", "achieved"):
        assert col in text
    assert text.index("aten::mm") < text.index("aten::relu")  # sorted by device time (mm is the largest)
    _check_trace(prof.chrome_trace())


def test_all_devices():
    with profile(device=None, target="trn2") as prof:
        torch.ones(4) + 1
    assert [e.name for e in prof.events] == ["aten::ones", "aten::add"]


def test_compiled_kernels_are_recorded_without_the_op_mode():
    f = torch.compile(lambda x, w: torch.relu(x @ w) * 2, backend="neuron")
    x, w = torch.randn(128, 128, device="neuron"), torch.randn(128, 128, device="neuron")
    f(x, w)
    with profile(ops=False, target="trn2") as prof:
        y = f(x, w)
    assert y.device.type == "neuron"
    assert [e.name for e in prof.events] == ["neuron::compiled_kernel"]
    assert prof.events[0].device == "neuron:0" and prof.events[0].device_s >= 30e-6  # at least one launch
    _check_trace(prof.chrome_trace())


def test_a_kernel_graph_is_costed_as_one_launch_of_fused_kernels():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x, w: torch.relu(x @ w) * 2)(torch.randn(256, 256), torch.randn(256, 256))
    t = target("trn2")
    c = kernel_cost(gm, t)
    assert c.flops == 2 * 256**3 + 2 * 256 * 256  # the matmul; relu and mul sweep 256x256 once each
    assert c.engine == "tensor" and c.overhead_s == t.launch_s
    # one fused kernel: reads x and w, writes the result; relu's output stays on chip
    assert c.bytes == pytest.approx(3 * 256 * 256 * 4)
