"""Memory snapshots in PyTorch's format (torch.neuron.memory._record_memory_history / _snapshot / _dump_snapshot),
rendered by PyTorch's own visualizer, and the per-process memory fraction."""
from __future__ import annotations

import base64
import pickle
import re
import subprocess
import sys

import pytest
import torch
from torch.cuda import _memory_viz

MiB = 1 << 20


@pytest.fixture
def history():
    torch.neuron.empty_cache()
    torch.neuron.memory._record_memory_history(stacks="python", clear_history=True)
    yield
    torch.neuron.memory._record_memory_history(None)


@pytest.fixture
def fraction():
    torch.neuron.empty_cache()
    yield
    torch.neuron.set_per_process_memory_fraction(1.0)
    torch.neuron.empty_cache()


def allocate_and_free():
    a = torch.empty(3 * MiB, dtype=torch.uint8, device="neuron")
    b = torch.empty(1000, dtype=torch.float32, device="neuron")
    addr_a, addr_b = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    del a
    return b, addr_a, addr_b


def test_history_records_what_the_test_allocated(history):
    b, addr_a, addr_b = allocate_and_free()
    snap = torch.neuron.memory._snapshot()
    trace = snap["device_traces"][0]
    acts = [(e["action"], e["addr"], e["size"]) for e in trace]
    assert acts == [("segment_alloc", addr_a, 3 * MiB), ("alloc", addr_a, 3 * MiB),
                    ("segment_alloc", addr_b, 4096), ("alloc", addr_b, 4096),  # rounded to 512 bytes
                    ("free_requested", addr_a, 3 * MiB), ("free_completed", addr_a, 3 * MiB)]
    assert all(any(f["name"] == "allocate_and_free" and f["filename"] == __file__ for f in e["frames"])
               for e in trace)
    seg = {s["address"]: s for s in snap["segments"]}
    (blk,) = seg[addr_b]["blocks"]
    assert blk["state"] == "active_allocated" and blk["size"] == 4096 and blk["requested_size"] == 4000
    assert any(f["name"] == "allocate_and_free" for f in blk["frames"])
    assert seg[addr_a]["blocks"][0]["state"] == "inactive"  # cached, not returned
    assert seg[addr_a]["segment_type"] == "large" and seg[addr_b]["segment_type"] == "small"
    assert torch.neuron.memory_snapshot() == snap["segments"]
    torch.neuron.empty_cache()
    assert torch.neuron.memory._snapshot()["device_traces"][0][-1] == {
        "action": "segment_free", "addr": addr_a, "size": 3 * MiB, "stream": 0, "frames": [],
        "time_us": torch.neuron.memory._snapshot()["device_traces"][0][-1]["time_us"]}
    del b


def test_memory_viz_renders_the_snapshot(history, tmp_path):
    b, addr_a, addr_b = allocate_and_free()
    path = tmp_path / "snapshot.pickle"
    torch.neuron.memory._dump_snapshot(str(path))
    snap = pickle.loads(path.read_bytes())
    # PyTorch's own readers of the format
    assert "reserved" in _memory_viz.segsum(snap)
    lines = _memory_viz.trace(snap).splitlines()  # replays the events as pseudo-code
    assert lines[1:8] == ["6 entries", f"a = cudaMalloc({addr_a}, 3.0MiB)", "b = a[0:3.0MiB]",
                          f"c = cudaMalloc({addr_b}, 4.0KiB)", "d = c[0:4.0KiB]", "del b # 3.0MiB",
                          "# free completed for b 3.0MiB"]
    for plot in (_memory_viz.trace_plot, _memory_viz.segment_plot):
        html = plot(snap)
        payload = re.search(r'"base64": "([^"]+)"', html).group(1)
        assert pickle.loads(base64.b64decode(payload)) == snap
    out = tmp_path / "trace.html"
    subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o", str(out)],
                   check=True, timeout=300)
    assert "Active Memory Timeline" in out.read_text()
    del b


def test_history_off_records_nothing():
    torch.neuron.memory._record_memory_history(None)
    x = torch.empty(100, device="neuron")
    assert torch.neuron.memory._snapshot()["device_traces"][0] == []
    del x


def test_per_process_memory_fraction_oom_and_recovery(fraction):
    cap = torch.neuron.get_device_properties(0).total_memory
    f = 64 * MiB / cap
    torch.neuron.set_per_process_memory_fraction(f)
    assert torch.neuron.get_per_process_memory_fraction() == f
    base = torch.neuron.memory_reserved()
    keep = torch.empty(40 * MiB - base, dtype=torch.uint8, device="neuron")
    with pytest.raises(torch.OutOfMemoryError, match=rf"per-process memory fraction {f:g}"):
        torch.empty(30 * MiB, dtype=torch.uint8, device="neuron")
    del keep
    again = torch.empty(60 * MiB, dtype=torch.uint8, device="neuron")  # the cache is released to make room
    assert again.device.type == "neuron"
    del again
    torch.neuron.set_per_process_memory_fraction(1.0)
    assert torch.neuron.get_per_process_memory_fraction() == 1.0


def test_invalid_fraction_errors_like_cuda():
    with pytest.raises(TypeError, match="must be `float`"):
        torch.neuron.set_per_process_memory_fraction(1)
    with pytest.raises(ValueError, match="Allowed range: 0~1"):
        torch.neuron.set_per_process_memory_fraction(1.5)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.neuron.set_per_process_memory_fraction(0.5, device=99)
    with pytest.raises(RuntimeError, match="context must be"):
        torch.neuron.memory._record_memory_history(context="bogus")


def test_state_only_and_max_entries():
    torch.neuron.memory._record_memory_history("state", stacks="python", clear_history=True)
    try:
        b, _, addr_b = allocate_and_free()
        snap = torch.neuron.memory._snapshot()
        assert snap["device_traces"][0] == []  # "state": no event history, only the live blocks' stacks
        (blk,) = next(s for s in snap["segments"] if s["address"] == addr_b)["blocks"]
        assert any(f["name"] == "allocate_and_free" for f in blk["frames"])
        torch.neuron.memory._record_memory_history(max_entries=2, stacks="python", clear_history=True)
        b2, addr_a, _ = allocate_and_free()
        assert [e["action"] for e in torch.neuron.memory._snapshot()["device_traces"][0]] == [
            "free_requested", "free_completed"]
    finally:
        torch.neuron.memory._record_memory_history(None)
    del b, b2


def test_oom_is_an_event_in_the_history(history, fraction):
    torch.neuron.set_per_process_memory_fraction(16 * MiB / torch.neuron.get_device_properties(0).total_memory)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(32 * MiB, dtype=torch.uint8, device="neuron")
    (oom,) = [e for e in torch.neuron.memory._snapshot()["device_traces"][0] if e["action"] == "oom"]
    assert oom["size"] == 32 * MiB and 0 <= oom["device_free"] <= 16 * MiB
    assert "OutOfMemoryError" in _memory_viz.trace(torch.neuron.memory._snapshot())
