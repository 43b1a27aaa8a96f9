"""What the asynchronous device hands back when something fails (issue 26): never a value that was not computed.

A kernel that fails on a stream worker raises its error once at the stream's next sync point (and at those of the
streams that waited for it); the memory it and the kernels depending on it should have written is poisoned: reading
it raises the same error again, naming the failed op, while independent work runs and returns the CPU's values.
Host-checkable errors raise at the call whatever is queued. `slow()` (tests/test_async.py) makes later work queue.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchneuron
from tests.test_async import DEV, needs_async, on_device, operands, slow
from torchneuron.compiler import eager_fusion


@pytest.fixture
def busy():
    """Device operands for a slow kernel, and every kernel with a known signature queued (small ones on an idle
    stream too, no inline fast path), so that what queues does not depend on timing; every test starts and ends with
    a drained, error-free device."""
    xd, wd = on_device(*operands())
    torchneuron._C._set_queue_everything(True)
    yield lambda n=3: slow(xd, wd, n)
    for _ in range(4):  # errors a test left pending (one per stream): reported here, not in the next test
        try:
            torchneuron._C._set_queue_everything(False)
            break
        except (RuntimeError, IndexError):
            pass


def _failing_index_select(src: torch.Tensor, busy) -> torch.Tensor:
    """index_select with an index out of range behind slow work, its signature (and `+ 1` of its result) made known
    first, so that they queue."""
    torch.index_select(src, 0, torch.tensor([0, 1], device=src.device)) + 1
    busy()
    return torch.index_select(src, 0, torch.tensor([0, 99], device=src.device))


@needs_async
def test_work_after_a_failed_kernel_is_computed_and_the_failed_result_never_reads_as_a_value(busy):
    x = torch.randn(64, 64)
    xd, src = x.to(DEV), torch.randn(8, 4, device=DEV)
    xd * 2  # its signature known: queued below
    bad = _failing_index_select(src, busy)
    y = xd * 2  # queued behind the failure, independent of it
    dependent = bad + 1  # queued: reads what the failed kernel did not write
    with pytest.raises(IndexError, match="index out of range"):
        torch.neuron.synchronize()
    torch.neuron.synchronize()  # raised once: the device goes on
    assert torch.equal(y.cpu(), x * 2)
    for t in (bad, dependent):
        with pytest.raises(IndexError, match="aten::index_select.*never computed"):
            t.cpu()
    with pytest.raises(IndexError, match="never computed"):
        bad.sum()  # a launch that reads it raises at the call
    with pytest.raises(IndexError):
        dependent[0, 0].item()
    bad.copy_(torch.ones(2, 4))  # overwritten whole: computed again
    assert torch.equal(bad.cpu(), torch.ones(2, 4))
    assert torch.equal((bad + 1).cpu(), torch.full((2, 4), 2.0))


@needs_async
def test_an_error_on_a_side_stream_surfaces_on_the_stream_that_waited_for_it(busy):
    side = torch.neuron.Stream()
    src = torch.randn(8, 4, device=DEV)
    torch.index_select(src, 0, torch.tensor([0, 1], device=DEV)).sum()  # signatures known: both queue below
    with torch.neuron.stream(side):
        busy()
        bad = torch.index_select(src, 0, torch.tensor([0, 99], device=DEV))
    torch.neuron.current_stream().wait_stream(side)
    total = bad.sum()
    with pytest.raises(IndexError, match="index out of range"):
        total.item()
    with pytest.raises(IndexError):
        total.item()  # still never computed
    side.synchronize()  # the user has seen the failure: no stream raises it again
    torch.neuron.synchronize()


@needs_async
def test_an_event_wait_carries_the_error_to_the_waiting_stream(busy):
    side = torch.neuron.Stream()
    src = torch.randn(8, 4, device=DEV)
    torch.index_select(src, 0, torch.tensor([0, 1], device=DEV))
    with torch.neuron.stream(side):
        busy()
        torch.index_select(src, 0, torch.tensor([0, 99], device=DEV))
        ev = torch.neuron.Event()
        ev.record()
    torch.neuron.current_stream().wait_event(ev)
    with pytest.raises(IndexError):
        torch.neuron.current_stream().synchronize()


def _two_failing_ops() -> tuple:
    """A side stream, and operands of two ops that can fail (index_select out of range, integer division by zero)
    whose signatures are known, so that later calls queue."""
    src = torch.randn(8, 4, device=DEV)
    a, ones, zeros = (torch.arange(4, device=DEV), torch.ones(4, dtype=torch.long, device=DEV),
                      torch.zeros(4, dtype=torch.long, device=DEV))
    torch.index_select(src, 0, torch.tensor([0, 1], device=DEV)), a // ones
    return torch.neuron.Stream(), src, a, zeros


@needs_async
def test_a_failure_after_one_another_stream_reported_is_raised_too(busy):
    """The default stream fails; a side stream that waited for it raises that failure at its sync point (the user has
    seen it). A later failure on the default stream is raised at the next sync point, not dropped behind the first
    (found by the long fuzz run, seed 1080006)."""
    side, src, a, zeros = _two_failing_ops()
    busy()
    torch.index_select(src, 0, torch.tensor([0, 99], device=DEV))
    side.wait_stream(torch.neuron.current_stream())
    ev = torch.neuron.Event()
    ev.record(side)
    with pytest.raises(IndexError, match="index out of range"):
        ev.synchronize()
    busy()
    a // zeros
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch.neuron.synchronize()
    torch.neuron.synchronize()  # each raised once


@needs_async
def test_a_side_streams_own_failure_behind_one_it_took_on_is_raised_next(busy):
    """A side stream takes on the default stream's failure (wait_stream), then fails itself. Its sync point raises
    the older failure; the next one raises the side stream's own, which is not lost behind it (found by the long fuzz
    run, seed 1080090), and each is raised once."""
    side, src, a, zeros = _two_failing_ops()
    busy()
    a // zeros
    side.wait_stream(torch.neuron.current_stream())
    with torch.neuron.stream(side):
        torch.index_select(src, 0, torch.tensor([0, 99], device=DEV))
    ev = torch.neuron.Event()
    ev.record(side)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        ev.synchronize()
    with pytest.raises(IndexError, match="index out of range"):
        side.synchronize()
    torch.neuron.synchronize()  # each raised once
    side.synchronize()


@needs_async
def test_a_skipped_kernels_result_sized_at_its_launch_is_poisoned(busy):
    """`abs` hands its kernel an empty out= tensor (ATen's composite: empty, then abs.out), whose memory exists only
    once the launch sizes it. Skipped behind a failure, that result is poisoned too, not uninitialised memory read
    as values (found by the long fuzz run, seed 1300539; probes/p34)."""
    torch.randn(2, 4, device=DEV).abs()  # the signature known: queued below
    r = _failing_index_select(torch.randn(8, 4, device=DEV), busy).abs()
    with pytest.raises(IndexError, match="index out of range"):
        torch.neuron.synchronize()
    with pytest.raises(IndexError, match="never computed"):
        r.cpu()


@needs_async
def test_a_copys_own_size_error_comes_before_the_failure_behind_its_source(busy):
    """copy_ from poisoned memory into a tensor of another size raises the CPU's size error (the copy's own check),
    also when the copy runs at once (small, on an idle stream), not the failure that left its source uncomputed
    (found by the long fuzz run, seed 80293); a copy that fits raises that failure."""
    bad = _failing_index_select(torch.randn(8, 4, device=DEV), busy)
    with pytest.raises(IndexError, match="index out of range"):
        torch.neuron.synchronize()
    torchneuron._C._set_queue_everything(False)  # small copies on an idle stream run now
    dst = torch.zeros(6, 4, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match="must match the size"):
        dst.copy_(bad)
    with pytest.raises(IndexError, match="never computed"):
        dst[:2].copy_(bad)


def test_host_checkable_errors_raise_at_the_call_while_work_is_queued(busy):
    """Overlap and broadcasting in copy_ are the CPU's checks at the call; the ops launched between are not skipped."""
    v = torch.arange(16.0, device=DEV)
    busy()
    c = torch.arange(16.0)
    with pytest.raises(RuntimeError, match="unsupported operation") as cpu_err:
        c[1:].copy_(c[:-1])
    with pytest.raises(RuntimeError, match="unsupported operation") as dev_err:
        v[1:].copy_(v[:-1])
    assert str(cpu_err.value).split("\n")[0] == str(dev_err.value).split("\n")[0]
    w = v * 2
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.empty(3, 4, device=DEV).copy_(torch.ones(5, device=DEV))
    assert torch.equal(w.cpu(), torch.arange(16.0) * 2)
    torch.neuron.synchronize()  # nothing pending


@needs_async
def test_integer_division_by_zero_never_fuses_and_an_in_place_op_before_it_applies_once(busy):
    """A fused group whose kernel stores `x` and then raises would leave `x` added twice when re-run unfused; integer
    division may raise on a value, so it never joins a group (op table: int_errors) and the error is the CPU's."""
    n = eager_fusion.MIN_ELEMENTS  # large enough to fuse
    for step in range(4):  # a group is compiled at its AFTER-th sighting: later steps would run it fused
        busy(1)
        x = torch.zeros(n, dtype=torch.int32, device=DEV)
        a = torch.full((n,), 7, dtype=torch.int32, device=DEV)
        d = torch.ones(n, dtype=torch.int32, device=DEV)
        if step == 3:
            d[5] = 0
        x.add_(1)
        q = a // d
        r = q * 3
        if step < 3:
            assert torch.equal(r.cpu(), torch.full((n,), 21, dtype=torch.int32))
            eager_fusion.wait_compiles()  # the hot group's kernel is ready for the next step
            continue
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            torch.neuron.synchronize()
        assert torch.equal(x.cpu(), torch.ones(n, dtype=torch.int32))  # applied once, as on the CPU
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            r.cpu()


def _modules_with_missing_optional_outputs() -> dict[str, tuple]:
    """Layers whose backward leaves an optional gradient undefined (no bias, no affine weight, no mask)."""
    return {
        "layer_norm_no_bias": (lambda x, w: F.layer_norm(x, (32,), w, None, 1e-5), (4, 8, 32), (32,)),
        "layer_norm_no_affine": (lambda x, w: F.layer_norm(x, (32,), None, None, 1e-5) * w, (4, 8, 32), (32,)),
        "group_norm_no_bias": (lambda x, w: F.group_norm(x, 4, w, None), (4, 8, 6), (8,)),
        "rms_norm_no_weight": (lambda x, w: F.rms_norm(x, (32,)) * w, (4, 8, 32), (32,)),
        "linear_no_bias": (lambda x, w: F.linear(x, w), (4, 32), (16, 32)),
        "conv_no_bias": (lambda x, w: F.conv1d(x, w), (2, 4, 16), (8, 4, 3)),
        "batch_norm_no_affine": (lambda x, w: F.batch_norm(x, None, None, training=True) * w, (6, 8), (8,)),
        "sdpa_no_mask": (lambda x, w: F.scaled_dot_product_attention(x, x * w, x), (2, 2, 8, 16), (16,)),
    }


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("case", sorted(_modules_with_missing_optional_outputs()))
def test_ops_with_undefined_optional_outputs_on_the_queued_path(case, autocast):
    """nanoGPT's bias=False layer norm under autocast: the queued path returned None where the schema returns an
    undefined Tensor ('Expected Tensor but got None'). Every path, every such op: gradients equal the CPU's."""
    fn, xs, ws = _modules_with_missing_optional_outputs()[case]
    g = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(xs, generator=g), torch.randn(ws, generator=g)

    def grads(device: str) -> list[torch.Tensor]:
        out = []
        for _ in range(3):  # the first call runs on the host; later ones queue with the learned layout
            x, w = x0.to(device, copy=True).requires_grad_(), w0.to(device, copy=True).requires_grad_()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                y = fn(x, w)
            y.float().pow(2).sum().backward()
            out = [x.grad.cpu(), w.grad.cpu()]
        return out

    torchneuron._C._set_queue_everything(True)
    try:
        dev = grads(DEV)
    finally:
        torchneuron._C._set_queue_everything(False)
    for a, b in zip(dev, grads("cpu"), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2 if autocast else 1e-5, atol=2e-2 if autocast else 1e-5)


def test_deterministic_algorithms_give_the_cpus_bits_at_every_thread_count():
    """Reductions split by thread count; under torch.use_deterministic_algorithms(True) every kernel runs with the
    CPU's thread count (no one-thread-fewer rule) and no fusion, so results equal the CPU's bit for bit."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, 200, generator=g), torch.randn(200, 300, generator=g)
    saved = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    try:
        for threads in sorted({1, 2, 4, saved}):
            torch.set_num_threads(threads)
            cpu = [(a @ b).sum(1), torch.softmax(a, 1).mean(0), (a * 3).exp().sum()]
            ad, bd = a.to(DEV), b.to(DEV)
            dev = [(ad @ bd).sum(1), torch.softmax(ad, 1).mean(0), (ad * 3).exp().sum()]
            for c, d in zip(cpu, dev, strict=True):
                assert torch.equal(c, d.cpu()), threads
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(saved)


@needs_async
def test_an_ops_own_argument_error_comes_before_the_failure_it_would_read(busy):
    """A host-checkable error of the op itself is the CPU's, even when it reads memory a failure left uncomputed;
    the failure, once raised through a read, is not raised again at the next sync point."""
    src = torch.randn(8, 4, device=DEV)
    bad = _failing_index_select(src, busy)
    ints = torch.ones(2, 4, dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
        ints.div_(bad)  # true division's float result cannot be stored in an int tensor: the CPU's error
    with pytest.raises(IndexError, match="never computed"):
        bad.cpu()
    torch.neuron.synchronize()  # seen already: nothing raised


@needs_async
def test_memory_freed_while_its_failing_kernel_is_queued_is_the_next_tensors_and_never_poisoned(busy):
    """A result dropped on the host while the kernel writing it is still queued gives its memory back at once (the
    stream's later allocations reuse it, as CUDA's allocator does); the failure, landing afterwards, belongs to the
    dropped tensor only: the next tensor there computes and reads as the CPU's, even after a partial write."""
    torch.neuron.empty_cache()  # no cached block of the size below but the one freed
    src = torch.randn(8, 1531, device=DEV)
    bad = _failing_index_select(src, busy)
    freed = bad.data_ptr()
    del bad  # freed on the host: the failing kernel is still queued
    fresh = torch.empty(2, 1531, device=DEV)
    assert fresh.data_ptr() == freed, "premise: the stream reuses the block at once"
    fresh[0].fill_(3.0)  # a write that covers part of the storage only
    total = fresh[0].sum()
    with pytest.raises(IndexError, match="index out of range"):
        torch.neuron.synchronize()  # the failure itself is still reported, once
    assert total.item() == 3.0 * 1531
    assert torch.equal(fresh[0].cpu(), torch.full((1531,), 3.0))
    assert torchneuron._C._poisoned_storages() == 0, "nothing left poisoned: the fast path stays on"
