"""Streams and events: torch.neuron.Stream/Event and the generic torch.Stream/torch.Event on `neuron`."""
import time

import pytest
import torch


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
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    a = torch.randn(512, 512, device="neuron")
    for _ in range(5):
        a = a @ a / 512
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end)
    assert 0 < ms and ms >= 0.5 * host_ms


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


def test_stream_on_invalid_device():
    with pytest.raises(IndexError, match="valid indices are 0..3"):
        torch.neuron.Stream(device=8)
