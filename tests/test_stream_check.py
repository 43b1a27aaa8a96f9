"""The stream-hazard checker (torch.neuron.stream_check, TORCHNEURON_STREAM_CHECK=1): each hazard kind is reported
with both Python stacks, correctly ordered code is not, and it is off (no dispatch mode) unless asked for."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from torchneuron.device.stream_check import StreamHazardError, checking, disable, enable, is_enabled

N = "neuron"


def side_stream() -> torch.neuron.Stream:
    return torch.neuron.Stream()


def write_on_default() -> torch.Tensor:
    return torch.zeros(4, 3, device=N)


def read_on(s: torch.Stream, x: torch.Tensor) -> torch.Tensor:
    with torch.neuron.stream(s):
        return x * 2


def write_on(s: torch.Stream, x: torch.Tensor) -> None:
    with torch.neuron.stream(s):
        x.fill_(1)


def assert_report(err: StreamHazardError, kind: str, now_fn: str, then_fn: str, x_ptr: int) -> str:
    msg = str(err)
    assert err.hazards[0].kind == kind and msg.count(kind) >= 1
    assert "shape (4, 3), dtype torch.float32" in msg and f"{x_ptr:#x}" in msg
    assert "stream 0 of neuron:0 (the default stream)" in msg and re.search(r"stream [1-9]\d* of neuron:0", msg)
    # both stacks, each ending in the function that made its access, under its own heading
    now_stack, then_stack = msg.split("\nThe earlier ", 1)
    assert f"in {now_fn}" in now_stack.split("at:\n", 1)[1] and __file__ in now_stack
    assert f"in {then_fn}" in then_stack and __file__ in then_stack
    return msg


def test_read_after_write_on_another_stream_is_reported():
    with checking():
        s = side_stream()
        x = write_on_default()
        with pytest.raises(StreamHazardError) as e:
            read_on(s, x)
    msg = assert_report(e.value, "read-after-write", "read_on", "write_on_default", x.untyped_storage().data_ptr())
    assert "aten::mul reads" in msg and "aten::zeros on stream 0" in msg


def test_write_after_read_is_reported():
    with checking():
        s = side_stream()
        x = write_on_default()
        s.wait_stream(torch.neuron.current_stream())  # the read is ordered after the write ...
        read_on(s, x)
        with pytest.raises(StreamHazardError) as e:
            x.add_(1)  # ... but this write is not ordered after the read
    msg = assert_report(e.value, "write-after-read", "test_write_after_read_is_reported", "read_on",
                        x.untyped_storage().data_ptr())
    assert "aten::add_ writes" in msg and "aten::mul on stream" in msg


def test_write_after_write_is_reported():
    with checking():
        s = side_stream()
        x = write_on_default()
        with pytest.raises(StreamHazardError) as e:
            write_on(s, x)
    assert_report(e.value, "write-after-write", "write_on", "write_on_default", x.untyped_storage().data_ptr())


def use_then_free(record: bool) -> None:
    s = side_stream()
    x = write_on_default()
    s.wait_stream(torch.neuron.current_stream())
    read_on(s, x)
    if record:
        x.record_stream(s)
    del x  # its block goes back to the default stream's pool while s may still read it
    torch.ones(1, device=N)  # the next op raises what the free found


def test_free_without_record_stream_is_reported():
    with checking(), pytest.raises(StreamHazardError) as e:
        use_then_free(record=False)
    h = e.value.hazards[0]
    assert h.kind == "free-without-record_stream" and h.earlier.kind == "read" and h.earlier.op == "aten::mul"
    msg = str(e.value)
    assert "record_stream" in msg and "shape (4, 3), dtype torch.float32" in msg and f"{h.data_ptr:#x}" in msg
    assert re.search(r"reuse on stream 0 of neuron:0 .*\) while stream [1-9]\d* of neuron:0 may still be reading it in "
                     r"aten::mul", msg)
    free_stack, read_stack = msg.split("\nThe earlier ", 1)
    assert "in use_then_free" in free_stack.split("at:\n", 1)[1] and "in read_on" in read_stack


def test_free_after_record_stream_is_not_reported():
    with checking():
        use_then_free(record=True)


def test_free_after_the_streams_are_ordered_is_not_reported():
    with checking():
        s = side_stream()
        x = write_on_default()
        s.wait_stream(torch.neuron.current_stream())
        read_on(s, x)
        torch.neuron.current_stream().wait_stream(s)
        del x
        torch.ones(1, device=N)


def ordered_by(edge: str) -> None:
    """Write on a side stream, order it before the default stream by `edge`, then use the result there."""
    s, cur = side_stream(), torch.neuron.current_stream()
    x = write_on_default()
    if edge == "wait_stream":
        s.wait_stream(cur)
    else:
        e = torch.neuron.Event()
        e.record(cur)
        s.wait_event(e) if edge == "event" else e.synchronize()
    write_on(s, x)
    if edge == "wait_stream":
        cur.wait_stream(s)
    elif edge == "event":
        e = s.record_event()
        e.wait(cur)
    else:
        {"stream.synchronize": s.synchronize, "device.synchronize": torch.neuron.synchronize,
         "event.synchronize": s.record_event().synchronize}[edge]()
    assert (x + 1).sum().item() == 24


@pytest.mark.parametrize("edge", ["wait_stream", "event", "stream.synchronize", "device.synchronize",
                                  "event.synchronize"])
def test_correctly_ordered_code_is_not_reported(edge):
    with checking():
        ordered_by(edge)


def test_a_missing_edge_in_the_same_code_is_reported():
    """The negative tests' program with the second edge left out: the checker is not silent on it."""
    with checking():
        s, cur = side_stream(), torch.neuron.current_stream()
        x = write_on_default()
        s.wait_stream(cur)
        write_on(s, x)
        with pytest.raises(StreamHazardError, match="read-after-write"):
            x + 1


def test_a_blocking_copy_to_the_host_orders_later_work():
    with checking():
        s = side_stream()
        x = write_on_default()
        s.wait_stream(torch.neuron.current_stream())
        write_on(s, x)
        with torch.neuron.stream(s):
            host = x.cpu()  # the host waits for s
        assert torch.equal((x + 1).cpu(), host + 1)


def test_using_a_non_blocking_copy_on_the_host_before_a_sync_is_reported():
    """The timing bug of asynchronous copies: the host reads a device-to-host copy (or overwrites the source of a
    host-to-device one) that the stream may not have done yet."""
    with checking():
        x = write_on_default() + 1
        h = x.to("cpu", non_blocking=True)
        with pytest.raises(StreamHazardError, match=r"read-after-write: aten::add reads .* on the host while "
                                                    r"aten::_to_copy on stream 0 of neuron:0"):
            h + 1
        src = torch.ones(4, 3)
        torch.empty(4, 3, device=N).copy_(src, non_blocking=True)
        with pytest.raises(StreamHazardError, match="write-after-read: aten::fill_ writes .* on the host"):
            src.fill_(2)
        h2 = x.to("cpu", non_blocking=True)
        torch.neuron.current_stream().synchronize()
        assert torch.equal(h2 + 1, torch.full((4, 3), 2.0))  # after the sync: no report


def test_same_stream_use_is_not_reported():
    with checking():
        s = side_stream()
        with torch.neuron.stream(s):
            x = torch.randn(16, 8, device=N)
            w = torch.randn(8, 4, device=N, requires_grad=True)
            loss = (x @ w).relu().sum()
            loss.backward()
            x.mul_(2)
            del x
            torch.ones(3, device=N)
        assert w.grad.shape == (8, 4)


def test_each_device_has_its_own_streams():
    """Memory of neuron:1 is allocated for, used on and freed from neuron:1's default stream: in order."""
    with checking():
        x = torch.rand(4, 3, device="neuron:1")
        y = x * 2
        del x, y
        torch.ones(1, device="neuron:1")
        z = torch.rand(4, 3, device="neuron:1")
        with pytest.raises(StreamHazardError, match=r"on stream [1-9]\d* of neuron:1 while aten::rand on stream 0 of "
                                                    r"neuron:1"):
            read_on(torch.neuron.Stream(device=1), z)


def test_a_copy_between_devices_is_ordered_on_both():
    with checking():
        d1 = torch.arange(6.0, device="neuron:1")
        d2 = d1.to("neuron:2")  # ordered after d1's write on neuron:1, and before later work on neuron:2
        assert torch.equal((d2 * 2).cpu(), torch.arange(6.0) * 2)
        d3 = d1.to("neuron:2")
        with pytest.raises(StreamHazardError, match="read-after-write"):
            read_on(torch.neuron.Stream(device=2), d3)  # another stream of neuron:2 is not ordered after the copy


def test_off_outside_the_block():
    assert not is_enabled()
    with checking():
        assert is_enabled() and torch._C._len_torch_dispatch_stack() == 1
    assert not is_enabled() and torch._C._len_torch_dispatch_stack() == 0
    s = side_stream()
    read_on(s, write_on_default())  # unchecked: no report


def test_a_checking_block_inside_an_enabled_checker_resumes_it():
    enable()
    try:
        s, x = side_stream(), write_on_default()
        with checking():
            assert torch._C._len_torch_dispatch_stack() == 1
            read_on(s, x)  # the block has its own state: x's write is not in it ...
        assert is_enabled() and torch._C._len_torch_dispatch_stack() == 1
        with pytest.raises(StreamHazardError, match="read-after-write"):
            read_on(s, x)  # ... and the outer checker still has it
    finally:
        disable()
    assert torch._C._len_torch_dispatch_stack() == 0


SCRIPT = textwrap.dedent("""
    import sys
    import torch
    print("loaded:", "torchneuron.device.stream_check" in sys.modules)
    print("checking:", torch.neuron.stream_check.is_enabled(), torch._C._len_torch_dispatch_stack())
    s = torch.neuron.Stream()
    x = torch.ones(8, device="neuron")
    with torch.neuron.stream(s):
        y = x + 1
    print("ran", y.sum().item())
""")


@pytest.mark.slow
@pytest.mark.parametrize("on", ["1", "0"])
def test_environment_variable(on):
    env = {**os.environ, "TORCHNEURON_STREAM_CHECK": on}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    if on == "1":
        assert r.returncode != 0 and "checking: True 1" in r.stdout and "ran" not in r.stdout
        assert "StreamHazardError" in r.stderr and "read-after-write: aten::add" in r.stderr
        assert 'File "<string>", line 9' in r.stderr and 'File "<string>", line 7' in r.stderr  # both stacks
    else:  # off by default costs nothing: the checker is not even imported, no dispatch mode is installed
        assert r.returncode == 0, r.stderr
        assert "loaded: False" in r.stdout and "checking: False 0" in r.stdout and "ran 16.0" in r.stdout


def test_an_op_error_under_the_checker_stays_that_error():
    """A temporary freed while the error propagates sends its free to the checker without disturbing the error."""
    with checking():
        with pytest.raises(RuntimeError, match="expected a neuron stream"):
            torch.ones(2, device=N).record_stream(torch.Stream(device="cpu"))
        with pytest.raises(IndexError):
            torch.ones(2, device=N)[5]
