"""Asynchronous execution semantics (issue 15), modelled on PyTorch's CUDA stream, event and allocator tests.

Ordering is made observable with a *slow kernel*: a chain of 1024x1024 matmuls (~30 ms each on the CI box) queued
on one stream, while a tiny read on another stream or on the host races it. Tests of plain correctness (results
equal the CPU's after every kind of edge and sync point) hold on any build; tests whose premise is asynchrony
(`query()` is False while work is pending, launches return early, errors surface at the sync point, the allocator
hazard without `record_stream`) need the asynchronous device and fail on a synchronous one by design.

Racy cases assert only what must hold: an event recorded just before a producer's write that has not completed
proves the write had not started. Where a test needs work to be still pending, a `Gate` (tests/helpers.py) holds the
stream until the host opens it, so nothing depends on how fast the machine is; time is compared only as causal
bounds on the events' own clock (no ratios, no sleeps).
"""
from __future__ import annotations

import functools
import inspect
import os
import re
import threading
import time
from copy import deepcopy

import pytest
import torch
from helpers import Gate, stamp

import torchneuron
from tests.conftest import run_py

N = 1024
SLOW = 6  # matmuls in the slow kernel: ~0.2 s here, long enough that a launch or a tiny read always finishes first
DEV = "neuron"
# the premise is asynchronous execution: fails on a synchronous build by design (deselect with -m "not needs_async")
needs_async = pytest.mark.needs_async


def slow(x: torch.Tensor, w: torch.Tensor, n: int = SLOW) -> torch.Tensor:
    """The slow kernel: n dependent matmuls (bounded by tanh), the same arithmetic on any device."""
    for _ in range(n):
        x = torch.tanh(x @ w)
    return x


def operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, N, generator=g), torch.randn(N, N, generator=g) / N ** 0.5


@functools.cache
def reference(seed: int = 0, n: int = SLOW) -> torch.Tensor:
    """The slow kernel on the CPU, computed once per inputs (tests use the same ones unless they need two); callers
    must not modify it."""
    return slow(*operands(seed), n)


def on_device(*ts: torch.Tensor) -> list[torch.Tensor]:
    """Copies to the device, complete before anything after uses them."""
    out = [t.to(DEV) for t in ts]
    torch.neuron.synchronize()
    return out


def launch_line() -> int:
    """The line number of the caller's next line (the launch whose stack an error must name)."""
    return inspect.currentframe().f_back.f_lineno + 1


def warm_operands(seed: int = 0) -> list[torch.Tensor]:
    """Device operands whose slow kernel already ran once: a first call of an op signature runs on the host thread
    after the stream's queued work, so launched behind a closed `Gate` it would wait for the gate."""
    xd, wd = on_device(*operands(seed))
    slow(xd, wd, 1)
    torch.neuron.synchronize()
    return [xd, wd]


@pytest.fixture(autouse=True)
def _drained():
    """No test leaves queued work (or an unreported error) for the next one, and each starts on the default
    stream."""
    torch.neuron.synchronize()
    yield
    torch.neuron.set_stream(torch.neuron.default_stream())
    torch.neuron.synchronize()


# ---------------------------------------------------------------- ordering


def test_work_on_one_stream_runs_in_issue_order():
    """In-place updates queued after the slow kernel on one stream see its result, read on that stream."""
    x, w = operands()
    ref = (reference() + 1).mul_(2)[::7]
    side = torch.neuron.Stream()
    xd, wd = on_device(x, w)
    with torch.neuron.stream(side):
        buf = torch.zeros(N, N, device=DEV)
        buf.copy_(slow(xd, wd)).add_(1).mul_(2)
        got = buf[::7].clone()
        torch.testing.assert_close(got.cpu(), ref)


@pytest.mark.parametrize("edge", ["wait_stream", "Stream.wait_event", "Event.wait"])
def test_edge_orders_a_read_on_another_stream_after_the_producer(edge):
    """With an ordering edge the consumer stream's read equals the CPU reference every time."""
    x, w = operands()
    ref = reference()
    xd, wd = on_device(x, w)
    main, side = torch.neuron.current_stream(), torch.neuron.Stream()
    for _ in range(2):
        out = torch.zeros(N, N, device=DEV)
        side.wait_stream(main)  # `out` exists before the side stream writes it
        with torch.neuron.stream(side):
            out.copy_(slow(xd, wd))
            done = torch.neuron.Event()
            done.record()
        if edge == "wait_stream":
            main.wait_stream(side)
        elif edge == "Stream.wait_event":
            main.wait_event(done)
        else:
            done.wait(main)
        read = out * 1  # on the main stream, after the edge
        torch.testing.assert_close(read.cpu(), ref)


@needs_async
def test_without_an_edge_a_read_on_another_stream_can_see_unfinished_data():
    """The bug `wait_stream` prevents: a tiny read on the main stream runs while the side stream's slow producer is
    still queued, and sees the value from before the producer's write."""
    xd, wd = on_device(*operands())
    main, side = torch.neuron.current_stream(), torch.neuron.Stream()
    buf = torch.zeros(1, device=DEV)
    buf.fill_(0.0)  # the first call of a signature runs on the host after the stream's work: make this one known
    main.synchronize()
    with torch.neuron.stream(side):
        slow(xd, wd, 2 * SLOW)
        before_write = torch.neuron.Event()
        before_write.record()
        buf.fill_(1.0)
    assert not side.query(), "the side stream's slow work was already done when its launches returned"
    snap = buf.clone()  # main stream, no edge to the side stream
    main.synchronize()
    assert not before_write.query(), "the main stream's read waited for the side stream's unrelated work"
    assert snap.item() == 0.0  # the write had not started: the read saw the old value
    torch.neuron.synchronize()
    assert buf.item() == 1.0


@needs_async
def test_stream_context_queues_work_on_that_stream_only():
    xd, wd = on_device(*operands())
    main, side = torch.neuron.current_stream(), torch.neuron.Stream()
    with torch.neuron.stream(side):
        slow(xd, wd)
    assert not side.query() and main.query()
    side.synchronize()
    assert side.query()


# ---------------------------------------------------------------- synchronize / query


@needs_async
def test_query_is_false_while_slow_work_is_pending_and_true_after_synchronize():
    xd, wd = on_device(*operands())
    stream = torch.neuron.current_stream()
    for sync in ("event", "stream", "device"):
        slow(xd, wd)
        e = torch.neuron.Event()
        e.record()
        assert not e.query() and not stream.query() and not torch.neuron.query()
        {"event": e.synchronize, "stream": stream.synchronize, "device": torch.neuron.synchronize}[sync]()
        assert e.query() and stream.query()


def test_synchronize_waits_for_every_stream():
    """torch.neuron.synchronize and torch.accelerator.synchronize complete the work of all streams of the device;
    results are then right on the host without any edge."""
    x, w = operands()
    ref = reference()
    xd, wd = on_device(x, w)
    e = torch.neuron.Event()
    assert e.query()  # never recorded: nothing to wait for (as CUDA)
    for sync in (torch.neuron.synchronize, torch.accelerator.synchronize):
        streams = [torch.neuron.Stream() for _ in range(2)]
        outs = []
        for s in streams:
            with torch.neuron.stream(s):
                outs.append(slow(xd, wd))
        sync()
        assert all(s.query() for s in streams)
        for o in outs:
            assert o.device.type == DEV
            torch.testing.assert_close(o.cpu(), ref)


# ---------------------------------------------------------------- timing


@needs_async
def test_launch_returns_before_the_work_ends():
    """The slow kernel's launches return while the stream is held (a launch that waited for its work would wait for
    the gate, which then times out instead of being opened), and the work runs once the stream moves on."""
    xd, wd = warm_operands()
    with Gate() as gate:
        out = slow(xd, wd)
        assert not torch.neuron.current_stream().query(), "the stream finished while held"
    torch.neuron.synchronize()
    assert gate.released, "a launch waited for the queued work"
    torch.testing.assert_close(out.cpu(), reference())


def test_elapsed_time_measures_the_work_between_the_events():
    """elapsed_time is the device time between the two records: it covers the slow kernel (stamped just before
    and after it on the stream) and lies inside the host interval enclosing both records and the wait."""
    xd, wd = on_device(*operands())
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    stamps: list[int] = []
    t0 = time.monotonic_ns()
    start.record()
    stamp(stamps)
    slow(xd, wd)
    stamp(stamps)
    end.record()
    end.synchronize()
    t1 = time.monotonic_ns()
    ns = start.elapsed_time(end) * 1e6
    assert 0 < stamps[1] - stamps[0] <= ns <= t1 - t0, (stamps, ns, t1 - t0)


@needs_async
def test_a_host_timer_without_synchronize_misses_the_queued_work():
    """The timing bug: a host timer around queued work measures the launches only. With the stream held while the
    timer runs, none of the work is done when it stops; the events' interval lies entirely after that stop and
    before a timer stopped after synchronize(), so only the synchronized timer covers the real cost."""
    xd, wd = warm_operands()
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    with Gate() as gate:
        start.record()
        out = slow(xd, wd)
        end.record()
        unsynced = time.monotonic_ns()
        assert not end.query(), "the work between the events was done when the host timer stopped"
    torch.neuron.synchronize()
    synced = time.monotonic_ns()
    assert gate.released
    assert 0 < start.elapsed_time(end) * 1e6 <= synced - unsynced
    torch.testing.assert_close(out.cpu(), reference())


# ---------------------------------------------------------------- copies and host reads


def test_cpu_copy_is_blocking():
    x, w = operands()
    ref = reference()
    xd, wd = on_device(x, w)
    for copy in (lambda t: t.cpu(), lambda t: t.to("cpu"), lambda t: t.to("cpu", non_blocking=False)):
        host = copy(slow(xd, wd))
        assert torch.neuron.current_stream().query()  # the copy waited for the work it needed
        assert not host.is_pinned()
        torch.testing.assert_close(host, ref)


def test_non_blocking_copy_to_pinned_host_is_right_after_synchronize():
    x, w = operands()
    ref = reference()
    xd, wd = on_device(x, w)
    h = slow(xd, wd).to("cpu", non_blocking=True)
    assert h.is_pinned()
    pinned = torch.empty(N, N, pin_memory=True)
    pinned.copy_(slow(xd, wd), non_blocking=True)
    torch.neuron.synchronize()
    torch.testing.assert_close(h, ref)
    torch.testing.assert_close(pinned, ref)


@needs_async
def test_non_blocking_copy_to_pinned_host_returns_before_the_data_is_there():
    """Reading `h` here may see stale data (the bug the emulator now exposes); only the synchronize makes it
    right."""
    x, w = operands()
    ref = reference()
    xd, wd = on_device(x, w)
    h = slow(xd, wd).to("cpu", non_blocking=True)
    assert not torch.neuron.current_stream().query(), "the non_blocking copy waited for the slow producer"
    torch.neuron.synchronize()
    torch.testing.assert_close(h, ref)


def test_non_blocking_copy_from_pinned_host_to_device():
    x, w = operands()
    ref = reference()
    pinned = [t.pin_memory() for t in (x, w)]  # kept alive until the copies have run
    xd, wd = (t.to(DEV, non_blocking=True) for t in pinned)
    torch.testing.assert_close(slow(xd, wd).cpu(), ref)  # stream order: the copies run before the matmuls


def _queued_arange(xd: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """A (2, 4) device tensor that holds 0..7 only once the slow kernel queued before it has run."""
    buf = torch.zeros(2, 4, device=DEV)
    buf.copy_(slow(xd, wd, 3)[:2, :4] * 0 + torch.arange(8.0, device=DEV).view(2, 4))
    return buf


@pytest.mark.parametrize("read", ["item", "bool", "tolist", "print", "repr", "numpy"])
def test_host_reads_see_the_final_values_of_queued_work(read, capsys):
    xd, wd = on_device(*operands())
    t = _queued_arange(xd, wd)
    expected = torch.arange(8.0).view(2, 4)
    device_str = str(expected).removesuffix(")") + f", device='{t.device}')"
    if read == "item":
        assert t[1, 3].item() == 7.0
    elif read == "bool":
        assert bool(t[1, 3] == 7.0)
    elif read == "tolist":
        assert t.tolist() == expected.tolist()
    elif read == "print":
        print(t)
        assert capsys.readouterr().out == device_str + "\n"
    elif read == "repr":
        assert repr(t) == device_str
    else:
        assert (t.cpu().numpy() == expected.numpy()).all()


@pytest.mark.parametrize("op", ["nonzero", "masked_select", "mask_index", "unique"])
def test_data_dependent_ops_wait_for_queued_producers(op):
    """Output shape depends on the data: the op must see the producer's values, not the zeros before it."""
    xd, wd = on_device(*operands())
    buf = torch.zeros(N, N, device=DEV)
    buf.copy_(slow(xd, wd, 3))
    fn = {"nonzero": lambda t: torch.nonzero(t > 0.5), "masked_select": lambda t: torch.masked_select(t, t > 0.5),
          "mask_index": lambda t: t[t > 0.5],
          "unique": lambda t: torch.unique((t * 4).round())}[op]
    got = fn(buf)
    expected = fn(buf.cpu())  # the CPU op on the same data
    assert got.shape == expected.shape and expected.numel() > 1
    torch.testing.assert_close(got.cpu(), expected)


def test_queued_kernels_write_tensors_made_under_inference_mode():
    """Tensors made under torch.inference_mode are written by queued kernels (the copy in, an in-place op), which run
    on the stream's worker thread, outside the caller's inference mode."""
    m = torch.nn.Linear(N // 2, N // 2)  # 256K parameters: the copy in is queued, as is the in-place add
    x = torch.randn(64, N // 2)
    with torch.inference_mode():
        y = deepcopy(m).to(DEV)(x.to(DEV)).add_(1)
        assert y.is_inference()
        got = y.cpu()
    torch.testing.assert_close(got, m(x).detach() + 1)


def _attention(t: torch.Tensor, grad: bool) -> list[torch.Tensor]:
    q = t[:256].reshape(2, 4, 32, N).detach().requires_grad_(grad)  # fused-op inputs: the CPU flash kernel's case
    out = torch.nn.functional.scaled_dot_product_attention(q, q * 0.5, q, is_causal=True)
    return [out, *torch.autograd.grad(out.square().sum(), q)] if grad else [out]


def _convolution(t: torch.Tensor, grad: bool) -> list[torch.Tensor]:
    x = t[:512].reshape(2, 4, 256, 256).contiguous(memory_format=torch.channels_last).detach().requires_grad_(grad)
    w = (t[0, :288].reshape(8, 4, 3, 3) * 0.1).detach().requires_grad_(grad)
    out = torch.nn.functional.conv2d(x, w, padding=1)
    return [out, *torch.autograd.grad(out.square().sum(), (x, w))] if grad else [out]


@needs_async
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("kernel", [_attention, _convolution], ids=["attention", "convolution"])
def test_attention_and_convolution_are_queued_behind_the_streams_work(kernel, grad):
    """Explicit kernels run in stream order like the others: their launch returns while the slow work they read is
    pending (the host runs ahead past attention and convolution), and the results are the CPU's (convolution's
    layouts too, which a first call with the same signature learns on the host; attention's are the fused op's, as
    on CUDA)."""
    xd, wd = on_device(*operands())
    kernel(torch.zeros(N, N, device=DEV), grad)
    torch.neuron.synchronize()
    got = kernel(slow(xd, wd), grad)
    assert not torch.neuron.current_stream().query(), "an explicit kernel waited for the stream's work"
    expected = kernel(reference(), grad)
    for g, e in zip(got, expected, strict=True):
        assert g.stride() == e.stride() or kernel is _attention
        torch.testing.assert_close(g.cpu(), e)


@needs_async
def test_an_op_keeps_queueing_as_shapes_keep_changing():
    """The result layouts an op learns are a bounded memo that keeps what is in use and learns what is new: after
    far more shapes than one generation holds (a growing KV cache, variable-length batches), a new shape and a shape
    used all along are queued again, not left on the host thread for good."""
    hot = torch.ones(7, device=DEV)
    for n in range(8, 1000):
        torch.ones(n, device=DEV).cumsum(0)
        hot.cumsum(0)
    fresh = torch.ones(1000, device=DEV)
    fresh.cumsum(0)  # learnt
    xd, wd = on_device(*operands())
    torchneuron.clear_op_tracking()
    busy = slow(xd, wd)
    got = fresh.cumsum(0), hot.cumsum(0)
    assert torchneuron._C._queued_ops().get("aten::cumsum", 0) == 2
    del busy
    torch.testing.assert_close(got[0].cpu(), torch.arange(1, 1001.0))
    torch.testing.assert_close(got[1].cpu(), torch.arange(1, 8.0))


@needs_async
def test_convolution_keeps_queueing_as_shapes_keep_changing():
    """Convolution's learnt layouts are bounded too and keep learning: after hundreds of input shapes, a new
    shape's second call is queued behind the stream's work."""
    w = torch.randn(2, 1, 3, 3, device=DEV)
    for n in range(3, 400):
        torch.nn.functional.conv2d(torch.ones(1, 1, 3, n, device=DEV), w)
    x = torch.ones(1, 1, 3, 500, device=DEV)
    ref = torch.nn.functional.conv2d(x.cpu(), w.cpu())
    torch.nn.functional.conv2d(x, w)  # learnt
    xd, wd = on_device(*operands())
    busy = slow(xd, wd)
    got = torch.nn.functional.conv2d(x, w)
    assert not torch.neuron.current_stream().query(), "the convolution waited for the stream's work"
    del busy
    torch.testing.assert_close(got.cpu(), ref)


# ---------------------------------------------------------------- caching allocator across streams

ROWS = 1100  # (ROWS, N) float32 blocks are larger than the slow kernel's (N, N) ones, so only each other's fit


def _used_on_side_stream(xd_rows: torch.Tensor, wd: torch.Tensor, side: torch.Stream) -> torch.Tensor:
    side.wait_stream(torch.neuron.current_stream())
    with torch.neuron.stream(side):
        return slow(xd_rows[:N], wd)


@needs_async
def test_block_freed_while_another_stream_uses_it_is_reused_at_once_without_record_stream():
    """The CUDA bug, reproduced: the allocating stream gets the block back while the side stream still reads it."""
    torch.neuron.empty_cache()
    x, w = operands()
    side = torch.neuron.Stream()
    (wd,) = on_device(w)
    xd = torch.cat([x, torch.zeros(ROWS - N, N)]).to(DEV)
    y = _used_on_side_stream(xd, wd, side)
    ptr = xd.data_ptr()
    del xd
    z = torch.empty(ROWS, N, device=DEV)
    assert z.data_ptr() == ptr  # reused by the allocating stream at once
    assert not side.query(), "the side stream had finished before the block was reused: no hazard was exercised"
    torch.neuron.synchronize()
    torch.testing.assert_close(y.cpu(), reference())  # z was never written, so y is right here


@needs_async
def test_record_stream_delays_reuse_until_the_other_stream_is_done():
    torch.neuron.empty_cache()
    x, w = operands()
    side = torch.neuron.Stream()
    (wd,) = on_device(w)
    xd = torch.cat([x, torch.zeros(ROWS - N, N)]).to(DEV)
    y = _used_on_side_stream(xd, wd, side)
    ptr = xd.data_ptr()
    xd.record_stream(side)
    del xd
    reserved = torch.neuron.memory_reserved()
    z = torch.empty(ROWS, N, device=DEV).fill_(float("nan"))  # would corrupt y if it took x's block
    assert z.data_ptr() != ptr, "allocation reused too soon"
    assert torch.neuron.memory_reserved() == reserved + ROWS * N * 4  # a new segment instead
    side.synchronize()
    torch.testing.assert_close(y.cpu(), reference())
    reserved = torch.neuron.memory_reserved()
    again = torch.empty(ROWS, N, device=DEV)
    assert again.data_ptr() == ptr, "allocation not reused after the side stream finished"
    assert torch.neuron.memory_reserved() == reserved


def test_blocks_held_by_record_stream_are_freed_on_out_of_memory():
    """Blocks whose reuse record_stream delays are waited for and reclaimed when memory runs out (CUDA's #19219),
    instead of raising OutOfMemoryError."""
    torch.neuron.empty_cache()
    chunk = 8 << 20  # bytes
    total = torch.neuron.get_device_properties(0).total_memory
    saved = torch.neuron.get_per_process_memory_fraction()
    side = torch.neuron.Stream()
    with torch.neuron.stream(side):
        acc = torch.zeros(chunk // 4, device=DEV)
    torch.neuron.set_per_process_memory_fraction((torch.neuron.memory_reserved() + 4 * chunk) / total)
    try:
        for _ in range(24):  # 24 x 8 MiB through a 32 MiB budget
            x = torch.ones(chunk // 4, device=DEV)
            side.wait_stream(torch.neuron.current_stream())
            with torch.neuron.stream(side):
                acc += x
            x.record_stream(side)
            del x
        torch.neuron.synchronize()
        assert acc[:3].tolist() == [24.0] * 3
    finally:
        torch.neuron.set_per_process_memory_fraction(saved)
        torch.neuron.empty_cache()


# ---------------------------------------------------------------- errors


@needs_async
@pytest.mark.parametrize("op,sync", [("index_select", "synchronize"), ("gather", "cpu")])
def test_error_in_a_queued_kernel_surfaces_at_the_next_sync_point(op, sync):
    """An out-of-range index queued behind slow work raises at the sync point, naming the op and the line of this
    file that launched it."""
    xd, wd = on_device(*operands())
    src = torch.randn(8, 4, device=DEV)
    idx = torch.tensor([0, 99], device=DEV)
    good = torch.tensor([0, 1], device=DEV)  # the first call of a signature runs (and raises) on the host: make
    torch.index_select(src, 0, good) if op == "index_select" else torch.gather(src, 0, good.view(1, 2))  # it known
    slow(xd, wd, 3)
    try:
        line = launch_line()
        out = torch.index_select(src, 0, idx) if op == "index_select" else torch.gather(src, 0, idx.view(1, 2))
    except (RuntimeError, IndexError) as e:
        pytest.fail(f"raised by the launch itself, not at the sync point (synchronous execution): {e}")
    with pytest.raises((RuntimeError, IndexError)) as info:
        torch.neuron.synchronize() if sync == "synchronize" else out.cpu()
    msg = str(info.value)
    assert f"aten::{op}" in msg and "out of" in msg
    assert re.search(rf"test_async\.py.*\b{line}\b", msg), msg


@pytest.mark.slow
def test_launch_blocking_runs_synchronously_and_the_op_raises_itself():
    """TORCHNEURON_LAUNCH_BLOCKING=1 (the AWS alias TORCH_NEURONX_ENABLE_ASYNC_NRT=0 maps onto it in the one
    configuration, tests/test_config.py)."""
    p = run_py(f"""
        import torch
        x = torch.randn({N}, {N}, device="neuron")
        for _ in range(3):
            x = x @ x
        print("done-at-launch", torch.neuron.current_stream().query())
        src, idx = torch.randn(8, 4, device="neuron"), torch.tensor([0, 99], device="neuron")
        try:
            torch.index_select(src, 0, idx)
        except IndexError as e:
            print("raised-by-op", e)
        """, env={"TORCHNEURON_LAUNCH_BLOCKING": "1"})
    assert "done-at-launch True" in p.stdout
    assert "raised-by-op" in p.stdout and "out of range" in p.stdout, p.stdout + p.stderr


# ---------------------------------------------------------------- threads


def test_two_threads_each_on_its_own_stream_get_correct_results():
    """The current stream is per thread (as CUDA's); each thread's queued work and reads are its own."""
    inputs = [operands(20 + i) for i in range(2)]
    refs = [reference(20 + i, 3) + i for i in range(2)]
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    main = torch.neuron.current_stream()

    def work(i: int) -> None:
        try:
            s = torch.neuron.Stream()
            torch.neuron.set_stream(s)
            assert torch.neuron.current_stream() == s
            x, w = (t.to(DEV) for t in inputs[i])
            for _ in range(2):
                results[i].append(slow(x, w, 3).add_(i).cpu())
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert torch.neuron.current_stream() == main
    for i in range(2):
        assert len(results[i]) == 2
        for r in results[i]:
            torch.testing.assert_close(r, refs[i])



@needs_async
def test_two_host_threads_waiting_on_one_stream_each_wake_when_their_own_work_is_done():
    """A finished kernel wakes only a waiter whose point it reached: the waiter on the earlier event returns with
    its value while the later work is held on the stream, and the waiter on the later event is not lost."""
    x, w = warm_operands(0)
    first = slow(x, w, 2)
    early = torch.neuron.Event()
    early.record()
    with Gate() as gate:
        second = slow(first, w, 4)
        late = torch.neuron.Event()
        late.record()
        done: list[str] = []
        threads = {n: threading.Thread(target=lambda n=n, e=e: (e.synchronize(), done.append(n)))
                   for n, e in (("late", late), ("early", early))}
        for t in threads.values():
            t.start()
        threads["early"].join(120)
        assert done == ["early"] and not late.query(), "the early waiter was not woken while the later work waited"
    threads["late"].join(120)
    assert gate.released and done == ["early", "late"]
    torch.testing.assert_close(first.cpu(), reference(0, 2))
    torch.testing.assert_close(second.cpu(), slow(reference(0, 2), operands(0)[1], 4))


def test_kernel_threads_do_not_change_what_new_threads_start_with():
    """With the intra-op threads filling the cores, medium kernels run with one thread fewer on the stream worker;
    that is set for the worker alone. (at::set_num_threads would also set the count every later thread starts
    with: a thread started after such a kernel saw one thread fewer.)"""
    code = """
        import os, threading, torch
        n = os.cpu_count()
        torch.set_num_threads(n)
        x = torch.randn(1 << 16, device="neuron")
        for _ in range(50):
            x = (x * 1.0001).add_(1)  # queued medium kernels
        torch.neuron.synchronize()
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start(); t.join()
        assert seen == [n], (seen, n)
        assert torch.get_num_threads() == n
    """
    run_py(code)


def test_a_reduction_computes_the_same_bits_queued_on_the_host_and_every_run():
    """A full sum's split follows the thread count, so the count a kernel runs with is a rule of its launch, the
    same whether it runs on the host (its first call), queued behind other work, or inline: never of timing."""
    n = torch.get_num_threads()
    torch.set_num_threads(max(n, os.cpu_count() or 1))
    try:
        x = torch.randn(1 << 19, generator=torch.Generator().manual_seed(1)).to(DEV)
        torch.neuron.synchronize()
        xs, ws = on_device(*operands(0))
        first = x.sum()  # the first call of this signature: on the host thread
        sums = [first]
        for _ in range(4):
            slow(xs, ws, 1)  # busy stream: the sum is queued behind it
            sums.append(x.sum())
        torch.neuron.synchronize()
        sums.append(x.sum())  # idle stream
        values = [s.item() for s in sums]
        assert len(set(values)) == 1, values
    finally:
        torch.set_num_threads(n)

def test_a_small_kernel_runs_with_the_threads_of_its_launch_inline_or_queued():
    """The thread count rule covers small kernels too: one run inline on the host thread (its first call, an idle
    stream) takes the count its queued runs take. (It used to keep every thread: MKL opened a parallel region for
    each small matmul, and with the stream worker's threads about, waking the sleeping team cost more than the
    matmul; an LSTM's step ran three times slower than with every op inline.)"""
    seen: list[int] = []
    lib = torch.library.Library("tn_thread_probe", "DEF")
    lib.define("probe(Tensor x) -> Tensor")
    lib.impl("probe", lambda x: (seen.append(torch.get_num_threads()), x.clone())[1], "CPU")
    n, cores = torch.get_num_threads(), os.cpu_count() or 1
    torch.set_num_threads(cores)
    try:
        x = torch.randn(8, device=DEV)
        xd, wd = on_device(*operands())
        torch.ops.tn_thread_probe.probe(x)  # first call: on the host
        for _ in range(2):
            slow(xd, wd, 2)
            torch.ops.tn_thread_probe.probe(x)  # behind work: queued
        torch.neuron.synchronize()
        torch.ops.tn_thread_probe.probe(x)  # idle stream: inline
        torch.neuron.synchronize()
        assert seen == [max(1, cores - 1)] * 4, seen
    finally:
        torch.set_num_threads(n)
        del lib


def test_a_recurrent_kernel_takes_its_threads_by_one_steps_work():
    """An RNN layer splits one time step at a time, so the op table's recurrent ops count one step's work in the
    thread rule. (oneDNN's LSTM layer, counted whole, ran with a full team beside the host's, and that team slept and
    woke at each step's parallel regions: the LSTM took 10-14 ms at 2 threads against 1.7 ms at 1.)"""
    from torchneuron import _C
    from torchneuron.runtime import optable, policy

    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("the thread rule keeps every thread on one core")
    seen: list[int] = []
    lib = torch.library.Library("tn_steps_probe", "DEF")
    lib.define("steps(Tensor x) -> Tensor")
    lib.impl("steps", lambda x: (seen.append(torch.get_num_threads()), x.clone())[1], "CPU")
    n = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        x = torch.randn(64, 1 << 13, device=DEV)  # 2^19 elements: full work whole, 2^13 a step
        torch.ops.tn_steps_probe.steps(x)
        _C._set_op_table(*(optable.names(f) for f in ("native", "exact", "host_tensors", "indices", "overwrites")),
                         [*optable.names("recurrent"), "steps"], optable.structured())
        torch.ops.tn_steps_probe.steps(x)
        torch.neuron.synchronize()
        assert seen == [cores, cores - 1], f"{seen} {torchneuron.get_execution_paths()}"
    finally:
        policy.install_op_tables()
        torch.set_num_threads(n)
        del lib


def test_an_op_defined_after_another_library_is_deleted_is_its_own_op():
    """Op tracking finds an op by its schema's address, which a new operator can take once a deleted
    torch.library freed it: the new op gets its own counters, classification and result layouts, not the old op's
    (a layout learnt for the old op would hand out results of the wrong shape)."""
    for ns, fn in (("tn_first_lib", lambda x: x.clone()), ("tn_second_lib", lambda x: x.sum(0, keepdim=True))):
        lib = torch.library.Library(ns, "DEF")
        lib.define("op(Tensor x) -> Tensor")
        lib.impl("op", fn, "CPU")
        torchneuron.clear_op_tracking()
        x = torch.randn(4, 3, device=DEV)
        xd, wd = on_device(*operands())
        for _ in range(3):  # the first call learns a layout, the others are queued with it
            slow(xd, wd, 1)
            out = getattr(torch.ops, ns).op(x)
        torch.testing.assert_close(out.cpu(), fn(x.cpu()))
        assert torchneuron.get_fallback_ops() == {f"{ns}::op": 3}
        del lib


def test_a_queued_kernel_runs_with_the_grad_mode_of_its_launch():
    """Some CPU kernels return other results with grad enabled (oneDNN's LSTM layer keeps a workspace for its
    backward only then): a kernel sees its launching thread's grad mode wherever it runs, and a signature learnt in
    one mode is not replayed in the other."""
    seen: list[bool] = []
    lib = torch.library.Library("tn_grad_probe", "DEF")
    lib.define("probe(Tensor x) -> Tensor")
    lib.impl("probe", lambda x: (seen.append(torch.is_grad_enabled()), x.clone())[1], "CPU")
    try:
        x = torch.randn(8, device=DEV)
        xd, wd = on_device(*operands())
        modes = [True, False, False, True, False]
        for grad in modes:  # the first of each mode on the host, the others queued behind work
            slow(xd, wd, 1)
            with torch.set_grad_enabled(grad):
                torch.ops.tn_grad_probe.probe(x)
        torch.neuron.synchronize()
        assert seen == modes, seen
    finally:
        del lib


def test_an_out_argument_the_kernel_resizes_is_not_replayed_with_its_old_shape():
    """A layout is reused only when the first call left every argument's shape alone: `abs` of a 0-dim tensor runs
    `abs.out` into a 1-D empty tensor the CPU kernel resizes, and a queued replay must not return the stale shape."""
    xd, wd = on_device(*operands())
    x, v = torch.randn((), device=DEV), torch.randn(3, device=DEV)
    for _ in range(3):
        slow(xd, wd, 1)  # a busy stream: the second and third calls are queued
        a, b = x.abs(), torch.add(v, v, out=torch.empty(0, device=DEV))
        assert a.shape == () and b.shape == (3,)
        torch.testing.assert_close((a.cpu(), b.cpu()), (x.cpu().abs(), v.cpu() * 2))



@needs_async
@pytest.mark.parametrize("make", [lambda: torch.arange(64, device=DEV), lambda: torch.linspace(0, 1, 100, device=DEV),
                                  lambda: torch.arange(3, 99, 2, device=DEV)], ids=["arange", "linspace", "range"])
def test_an_empty_out_argument_is_sized_at_the_launch(make):
    """`torch.arange(T)` (position ids, every forward of a GPT) is an empty tensor an out= kernel sizes: the launch
    sizes it from the first call's layout (nothing to copy, nobody to wait for) and the kernel is queued."""
    ref = make().cpu()  # the first call: learns the layout on the host
    x, w = on_device(*operands(0))
    y = slow(x, w, 4)
    out = make()
    assert not torch.neuron.current_stream().query(), "the factory waited for the stream's work"
    assert torch.equal(out.cpu(), ref) and out.shape == ref.shape
    torch.testing.assert_close(y.cpu(), reference(0, 4))

def test_an_out_argument_sized_by_float_arguments_is_keyed_by_their_values():
    """`arange(start, end, step)` on the device is `arange.out` into an empty tensor, which the kernel resizes to a
    length its float arguments decide: an empty range first must not make a later range (same tensor metadata,
    other floats) replay as empty (what mvlgamma, which calls arange, returned under --queue-everything)."""
    xd, wd = on_device(*operands())
    for start, end, step in ((1.1, 1.1, 1.0), (0.0, 0.5, 0.5), (0.0, 0.5, 0.5), (-1.0, 2.0, 0.5), (1.1, 1.1, 1.0)):
        slow(xd, wd, 1)
        torch.testing.assert_close(torch.arange(start, end, step, device=DEV).cpu(), torch.arange(start, end, step))
    x = torch.rand(5, 5) * 3 + 1
    for p in (1, 3, 1):
        slow(xd, wd, 1)
        torch.testing.assert_close(torch.mvlgamma(x.to(DEV), p).cpu(), torch.mvlgamma(x, p))


def test_a_result_without_memory_is_never_replayed():
    """`sgn`'s gradient of a real input is an efficient zero tensor (a storage without memory): its layout is not
    reusable, so a queued replay cannot copy from nowhere; the gradient stays right on a busy stream."""
    xd, wd = on_device(*operands())
    x = torch.randn(20, 20)
    for _ in range(3):
        slow(xd, wd, 1)
        xn = x.to(DEV).requires_grad_()
        (g,) = torch.autograd.grad(xn.sgn().sum(), xn)
        torch.testing.assert_close(g.cpu(), torch.zeros(20, 20))


def _structured_cases() -> dict[str, tuple[str, callable]]:
    """op name: (the aten op it launches, a function of a device-agnostic input generator)."""
    F = torch.nn.functional
    return {
        "mm": ("aten::mm", lambda t: t(64, 96) @ t(96, 80)),
        "addmm": ("aten::addmm", lambda t: torch.addmm(t(80), t(64, 96), t(96, 80))),
        "bmm": ("aten::bmm", lambda t: torch.bmm(t(4, 16, 24), t(4, 24, 8))),
        "baddbmm": ("aten::baddbmm", lambda t: torch.baddbmm(t(4, 16, 8), t(4, 16, 24), t(4, 24, 8))),
        "log_softmax": ("aten::_log_softmax", lambda t: F.log_softmax(t(32, 100), -1)),
        "softmax": ("aten::_softmax", lambda t: F.softmax(t(8, 5, 70), 1)),
        "sum": ("aten::sum", lambda t: t(64, 300).sum(1)),
        "mean": ("aten::mean", lambda t: t(64, 300).mean(0, keepdim=True)),
        "amax": ("aten::amax", lambda t: t(30, 70).amax(1)),
        "cumsum": ("aten::cumsum", lambda t: t(40, 60).cumsum(1)),
        "nll_loss": ("aten::nll_loss_forward",
                     lambda t: F.nll_loss(t(64, 10), (t(64).abs() * 3).long(), reduction="sum")),
        "max_pool": ("aten::max_pool2d_with_indices",
                     lambda t: F.max_pool2d(t(2, 3, 16, 16), 2, return_indices=True)),
        "avg_pool": ("aten::avg_pool2d", lambda t: F.avg_pool2d(t(2, 3, 16, 16), 3, 2)),
        "gather": ("aten::gather", lambda t: t(20, 30).gather(1, (t(20, 7).abs() * 9).long())),
        "topk": ("aten::topk", lambda t: t(20, 30).topk(5, 1)),
    }


@needs_async
@pytest.mark.parametrize("case", list(_structured_cases()))
def test_a_structured_op_writes_its_queued_results_in_place_with_the_cpus_bits(case):
    """A structured op (ATen's functional and out= forms run one kernel: matmuls, softmax, reductions, losses,
    pooling, gather, topk) queued on a busy stream runs its out= form into the device memory handed out at the
    launch: no result made elsewhere and copied (`_C._copied_ops`), and the bits are the CPU's. At one thread,
    so that the CPU's reductions split their work as the device's kernel does."""
    name, fn = _structured_cases()[case]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def inputs(device):
            g = torch.Generator().manual_seed(0)
            return lambda *shape: torch.randn(*shape, generator=g).to(device)
        expect = fn(inputs("cpu"))
        xd, wd = on_device(*operands())
        for _ in range(2):  # each op's first calls behind work: on the host thread, learning their results' layouts
            busy = slow(xd, wd, 1)
            fn(inputs(DEV))
        busy = slow(xd, wd, 2)
        torchneuron.clear_op_tracking()
        got = fn(inputs(DEV))
        assert torchneuron._C._queued_ops().get(name, 0) == 1
        torch.neuron.synchronize()
        assert name not in torchneuron._C._copied_ops()
        del busy
        for g, e in zip(*(r if isinstance(r, tuple) else (r,) for r in (got, expect)), strict=True):
            assert g.device.type == DEV and g.stride() == e.stride()
            assert torch.equal(g.cpu(), e), case
    finally:
        torch.set_num_threads(n)


@needs_async
def test_an_op_without_an_out_form_makes_its_queued_results_in_the_launchs_memory():
    """Layer norm has no structured out= form: its functional kernel runs, and the CPU allocator hands its three
    allocations the device blocks the launch handed out (the first request of each size), so nothing is copied
    (`_C._copied_ops`) and the results equal the CPU's."""
    x = torch.randn(16, 64)
    F = torch.nn.functional
    xd, wd = on_device(*operands())
    for _ in range(2):  # its first call behind work: on the host thread, learning its results' layout
        busy = slow(xd, wd, 1)
        F.layer_norm(x.to(DEV), (64,))
    busy = slow(xd, wd, 1)
    torchneuron.clear_op_tracking()
    got = F.layer_norm(x.to(DEV), (64,))
    torch.neuron.synchronize()
    assert torchneuron._C._queued_ops().get("aten::native_layer_norm", 0) == 1
    assert "aten::native_layer_norm" not in torchneuron._C._copied_ops()
    del busy
    torch.testing.assert_close(got.cpu(), F.layer_norm(x, (64,)))


def _bag(mode: int, forward_only: bool = False):
    op = torch.ops.aten._embedding_bag_forward_only if forward_only else torch.ops.aten._embedding_bag
    weight, idx = torch.randn(20, 6, generator=torch.Generator().manual_seed(1)), torch.arange(8)
    return lambda t: op(weight.to(t.device), idx.to(t.device), idx.to(t.device), False, mode)


def _pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A user's op (not ATen's): (x + 1, x * 2)."""
    return torch.add(x, 1), torch.mul(x, 2)


_LIBS: list[torch.library.Library] = []  # kept alive: a library unregisters its ops when collected


def _user_pair(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not hasattr(torch.ops.tn_pair, "pair"):  # defined once per process (this module is also imported as tests.*)
        _LIBS.append(torch.library.Library("tn_pair", "FRAGMENT"))
        _LIBS[-1].define("pair(Tensor x) -> (Tensor, Tensor)")
        _LIBS[-1].impl("pair", _pair, "CPU")
    return torch.ops.tn_pair.pair(t)

# op, call, whether a queued call copies: where the kernel makes its results
_PLACEMENTS = {
    "in its blocks": ("aten::var_mean", lambda t: torch.var_mean(t, dim=1), False),
    "in its blocks, group norm": ("aten::native_group_norm", lambda t: torch.nn.functional.group_norm(t, 3), False),
    "after scratch of a result's size": ("aten::_embedding_bag", _bag(2), True),  # mode max
    # mean: two int64 results are made each in the other's block; they hold equal values (bag_size, max_indices), so
    # this case checks that such results are found and copied, not the order of the copies
    "in each other's blocks": ("aten::_embedding_bag_forward_only", _bag(1, forward_only=True), True),
    "a user's op, never handed blocks": ("tn_pair::pair", _user_pair, True),
}


@needs_async
@pytest.mark.parametrize("case", list(_PLACEMENTS))
def test_results_made_anywhere_by_a_queued_kernel_reach_the_launchs_memory(case):
    """However a kernel with neither out= form places its results (in the blocks its launch handed out; after asking
    for a result's size for scratch, so the result is made elsewhere; each in another result's block), the queued
    call's results are the CPU's. Only results made elsewhere are copied (counted); a user's op is never handed
    device memory (it may keep what it allocates), so its results are always copied."""
    name, fn, copies = _PLACEMENTS[case]
    x = torch.randn(8, 6, 16, 16)
    xd, wd = on_device(*operands())
    for _ in range(2):  # its first call behind work: on the host thread, learning its results' layout
        busy = slow(xd, wd, 1)
        fn(x.to(DEV))
    busy = slow(xd, wd, 1)
    torchneuron.clear_op_tracking()
    got = fn(x.to(DEV))
    torch.neuron.synchronize()
    assert torchneuron._C._queued_ops().get(name, 0) == 1
    assert (name in torchneuron._C._copied_ops()) == copies
    del busy
    for g, e in zip(got, fn(x), strict=True):
        assert g.dtype == e.dtype and g.stride() == e.stride()
        torch.testing.assert_close(g.cpu(), e)
