"""Streams and events: torch.neuron.Stream/Event and the generic torch.Stream/torch.Event on `neuron`."""
import gc
import time

import pytest
import torch
from helpers import stamp


def test_default_and_current_streams():
    s0 = torch.neuron.default_stream()
    assert s0.stream_id == 0 and s0.device_index == 0
    assert torch.neuron.current_stream() == s0
    s = torch.neuron.Stream()
    assert s != s0 and s.device_type == s0.device_type
    with torch.neuron.stream(s):
        assert torch.neuron.current_stream() == s
        assert torch.accelerator.current_stream() == s
    assert torch.neuron.current_stream() == s0


def test_streams_are_per_device_and_switch_device():
    s1 = torch.neuron.Stream(device=1)
    assert s1.device_index == 1
    with torch.neuron.stream(s1):
        assert torch.neuron.current_device() == 1
        assert torch.empty(1, device="neuron").device.index == 1
    assert torch.neuron.current_device() == 0
    assert torch.neuron.current_stream(1).stream_id == 0


def test_generic_torch_stream_and_set_stream():
    s = torch.Stream(device="neuron:2")
    torch.neuron.set_stream(s)
    assert torch.neuron.current_stream(2) == s
    torch.neuron.set_stream(torch.neuron.default_stream(2))
    assert s.query() and torch.neuron.current_stream(2).stream_id == 0


def test_work_is_complete_when_issued():
    s = torch.neuron.Stream()
    with torch.neuron.stream(s):
        x = torch.randn(64, 64, device="neuron") @ torch.randn(64, 64, device="neuron")
    e = s.record_event()
    assert e.query() and s.query()
    torch.neuron.current_stream().wait_stream(s)
    torch.neuron.current_stream().wait_event(e)
    torch.neuron.synchronize()
    assert x.shape == (64, 64)


def test_event_timing_measures_the_work_between_records():
    """The elapsed time between two events covers the work queued between them (stamped on the stream just before
    and after it) and lies inside the host interval enclosing both records and the wait: causal bounds on the
    events' clock, whatever the load."""
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    stamps: list[int] = []
    t0 = time.monotonic_ns()
    start.record()
    stamp(stamps)
    a = torch.randn(512, 512, device="neuron")
    for _ in range(5):
        a = a @ a / 512
    stamp(stamps)
    end.record()
    end.synchronize()
    t1 = time.monotonic_ns()
    ns = start.elapsed_time(end) * 1e6
    assert 0 < stamps[1] - stamps[0] <= ns <= t1 - t0, (stamps, ns, t1 - t0)


def test_generic_torch_event_on_neuron():
    a, b = torch.Event(device="neuron", enable_timing=True), torch.Event(device="neuron", enable_timing=True)
    a.record()
    b.record()
    assert a.elapsed_time(b) >= 0 and b.query()


def test_timing_requires_enable_timing():
    a, b = torch.neuron.Event(), torch.neuron.Event()
    a.record()
    b.record()
    with pytest.raises(ValueError, match="enable_timing"):
        a.elapsed_time(b)


def test_elapsed_time_requires_recorded_events():
    a, b = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    a.record()
    with pytest.raises(ValueError, match="recorded"):
        a.elapsed_time(b)


def test_an_interprocess_event_handle_is_refused_clearly():
    """CUDA code sharing an event with another process (`ipc_handle`) gets an error naming why at the call, not an
    AttributeError."""
    e = torch.neuron.Event(interprocess=True)
    e.record()
    with pytest.raises(RuntimeError, match="cannot be shared between processes"):
        e.ipc_handle()
    with pytest.raises(RuntimeError, match="cannot be shared between processes"):
        torch.neuron.Event.from_ipc_handle(0, b"")


def test_stream_on_invalid_device():
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal 8.*valid indices are 0..3"):
        torch.neuron.Stream(device=8)


def test_record_stream_with_caching_allocator_meaning():
    """record_stream (pipelines, FSDP): the use on another stream is recorded; once the tensor dies and that stream
    has run its queued work (idle here), the block is cached for its allocating stream, and the statistics stay
    exact. (Reuse while the other stream is busy: tests/test_async.py.)"""
    side = torch.neuron.Stream()
    gc.collect()  # earlier tests' garbage is not freed in the middle of this one
    torch.neuron.empty_cache()  # no block cached by earlier tests: the reuse below can only be x's or y's
    base = torch.neuron.memory_allocated()
    with torch.neuron.stream(side):
        x = torch.empty(1024, device="neuron").fill_(1.0)  # a 4 KiB block of the caching allocator
    x.record_stream(torch.neuron.current_stream())
    x.record_stream(side)
    y = x * 2  # memory adopted from the CPU kernel: also the allocator's
    y.record_stream(side)
    torch.empty(0, device="neuron").record_stream(side)  # no block at all
    assert torch.neuron.memory_allocated() == base + 2 * 4096
    ptrs = {x.data_ptr(), y.data_ptr()}
    del x, y
    assert torch.neuron.memory_allocated() == base
    with torch.neuron.stream(side):
        assert torch.empty(1024, device="neuron").data_ptr() in ptrs  # x's block, back in side's pool
    with pytest.raises(RuntimeError, match="expected a neuron stream"):
        torch.ones(2, device="neuron").record_stream(torch.Stream(device="cpu"))


def test_stream_priorities_and_generic_api():
    hi, lo, clamped = (torch.neuron.Stream(priority=p) for p in (-1, 0, -9))
    assert (hi.priority, lo.priority, clamped.priority) == (-1, 0, -1)  # clamped to the range, like CUDA
    assert torch.neuron.Stream.priority_range() == (0, -1) and torch.neuron.default_stream().priority == 0
    assert hi != lo and hi.query() and lo.query()
    hi.wait_stream(lo)
    hi.synchronize()
    g, e = torch.Stream(device="neuron", priority=-1), torch.Event(device="neuron")
    e.record(g)
    g.wait_event(e)
    e.synchronize()
    assert e.query() and g.query()
    with torch.neuron.stream(hi):
        assert torch.neuron.current_stream() == hi and torch.neuron.current_stream().priority == -1
    torch.neuron.set_stream(lo)
    assert torch.neuron.current_stream() == lo
    torch.neuron.set_stream(torch.neuron.default_stream())
