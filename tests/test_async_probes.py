"""Held-out probes of issue 26's semantics (probes/ has a standalone repro for each, named in its test's docstring),
each failing before its fix.
Unlike tests/test_async_errors.py, these run in the default mode (no queue-everything), as a user's program does;
`slow()` queues ~0.2 s of matmuls so that the launches after it really queue."""
from __future__ import annotations

import io
import pickle
import threading
import time

import pytest
import torch

from tests.conftest import run_py
from tests.helpers import Gate
from tests.test_async import DEV, needs_async, on_device, operands, slow

pytestmark = needs_async


def _drain() -> None:
    """Synchronize until nothing is pending (failures a test left behind are reported here, not in the next test)."""
    for _ in range(8):
        try:
            torch.neuron.synchronize()
            return
        except (RuntimeError, IndexError):
            pass


@pytest.fixture
def busy():
    """Queues the slow kernel on the current stream when called; every test ends with a drained device."""
    xd, wd = on_device(*operands())
    slow(xd, wd, 1)
    torch.neuron.synchronize()
    yield lambda: slow(xd, wd)
    torch.neuron.set_stream(torch.neuron.default_stream())
    _drain()


def _failing(busy, src: torch.Tensor | None = None) -> torch.Tensor:
    """An index_select whose index is out of range, queued behind slow work (its signature made known first)."""
    src = torch.randn(8, 4, device=DEV) if src is None else src
    torch.index_select(src, 0, torch.tensor([0, 1], device=DEV)) + 1
    busy()
    return torch.index_select(src, 0, torch.tensor([0, 99], device=DEV))


@pytest.mark.parametrize("write", ["pickle", "legacy_save"])
def test_serializing_a_poisoned_tensor_raises(busy, write):
    """probes/p02_pickle_poisoned.py: torch.save (zipfile) raises on a poisoned tensor; pickle.dumps and the legacy
    format hand back the uncomputed bytes."""
    bad = _failing(busy)
    with pytest.raises(IndexError):
        torch.neuron.synchronize()
    with pytest.raises(IndexError, match="never computed"):
        if write == "pickle":
            pickle.dumps(bad)
        else:
            torch.save(bad, io.BytesIO(), _use_new_zipfile_serialization=False)


@pytest.mark.parametrize("freed", ["failed_result", "skipped_result"])
def test_a_result_freed_while_queued_still_poisons_its_queued_readers(busy, freed):
    """probes/p05_freed_failed_result.py: `r = f(g(idx))` with g failing frees g's result (or a skipped
    intermediate) while queued; r must stay poisoned, as it does when the intermediate is kept."""
    src = torch.randn(8, 1024, device=DEV)
    (torch.index_select(src, 0, torch.tensor([0, 1, 2, 3] * 64, device=DEV)) * 2 + 1).cpu()  # signatures known
    torch.neuron.synchronize()
    busy()
    e = torch.index_select(src, 0, torch.tensor([0, 1, 2, 99] * 64, device=DEV))
    if freed == "failed_result":
        r = e * 2
    else:
        r = e * 2 + 1  # e * 2 is skipped, poisoned, and freed at once
    del e
    with pytest.raises(IndexError):
        torch.neuron.synchronize()
    with pytest.raises(IndexError, match="never computed"):
        r.cpu()


def test_a_training_step_behind_a_failed_embedding_lookup_updates_nothing(busy):
    """probes/p06_backward_after_failed_forward.py (and p26 for a failure inside backward): the step's backward and
    SGD update, queued behind an embedding lookup that fails, must leave every parameter poisoned or unchanged."""
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(8, 1024).to(DEV), torch.nn.Linear(1024, 1024).to(DEV)
    params = [*emb.parameters(), *lin.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    good = torch.tensor([[0, 1, 2, 3]] * 64, device=DEV)
    for _ in range(3):  # signatures known: the failing step queues
        opt.zero_grad()
        lin(emb(good)).pow(2).mean().backward()
        opt.step()
    torch.neuron.synchronize()
    before = [p.detach().cpu().clone() for p in params]
    busy()
    opt.zero_grad()
    lin(emb(torch.tensor([[0, 1, 2, 99]] * 64, device=DEV))).pow(2).mean().backward()
    opt.step()
    with pytest.raises(IndexError):
        torch.neuron.synchronize()
    for p, b in zip(params, before, strict=True):
        try:
            v = p.detach().cpu()
        except IndexError:
            continue
        assert torch.equal(v, b), "a parameter was updated from uncomputed memory"


def test_item_is_a_sync_point_that_raises_a_pending_failure(busy):
    """probes/p07_item_not_a_sync_point.py: docs/device.md lists `.item()` among the sync points; CUDA's `.item()`
    raises the sticky error."""
    o = torch.ones(1024, 1024, device=DEV)
    o.sum().item()
    _failing(busy)
    z = o.sum()
    with pytest.raises(IndexError):
        z.item()


@pytest.mark.parametrize("fill", ["zero_", "fill_"])
def test_filling_a_whole_poisoned_tensor_clears_it(busy, fill):
    """probes/p09_fill_zero_poisoned.py: copy_ and normal_ over a whole poisoned tensor clear it; zero_ and fill_
    (which read nothing) raise the old failure, so a buffer or a `zero_grad(set_to_none=False)` grad cannot be reset."""
    bad = _failing(busy)
    with pytest.raises(IndexError):
        torch.neuron.synchronize()
    bad.zero_() if fill == "zero_" else bad.fill_(3.0)
    assert torch.equal(bad.cpu(), torch.full((2, 4), 0.0 if fill == "zero_" else 3.0))


def test_a_failure_reaches_a_stream_through_a_stream_that_ran_a_new_signature(busy):
    """probes/p11_transitive_wait.py: a fails; b waits for a's event, then runs an op whose signature is new (its
    first call runs on the host after b's queue); c.wait_stream(b): c depends on the failure and must raise it."""
    a, b, c = torch.neuron.Stream(), torch.neuron.Stream(), torch.neuron.Stream()
    with torch.neuron.stream(a):
        _failing(busy)
        ev = torch.neuron.Event()
        ev.record()
    b.wait_event(ev)
    with torch.neuron.stream(b):
        torch.ones(1003, 1024, device=DEV) * 2  # a shape no other test uses: its first call
    c.wait_stream(b)
    with pytest.raises(IndexError):
        c.synchronize()


def test_independent_failures_on_two_streams_are_each_raised(busy):
    """probes/p27_device_sync_drops_second_failure.py: a's and b's kernels fail independently; successive sync
    points raise both (the second is otherwise lost: never raised, not printed at exit)."""
    a, b = torch.neuron.Stream(), torch.neuron.Stream()
    with torch.neuron.stream(a):
        _failing(busy)
    with torch.neuron.stream(b):
        _failing(busy, torch.randn(16, 4, device=DEV))
    raised = 0
    for _ in range(3):
        try:
            torch.neuron.synchronize()
        except IndexError:
            raised += 1
    assert raised == 2


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_compiled_kernels_out_of_range_index_raises_and_the_process_survives(threads):
    """probes/p13_compiled_index_oob_aborts.py: status 134, "terminate called ..." with more than one intra-op thread
    (Inductor's index check threw inside its OpenMP region). Expected an exception (CUDA: a device-side assert error
    at a sync point), for each kind of indirect index (a gather's, an embedding's, a scatter's: the store's index), and
    the device going on afterwards."""
    p = run_py("""
        import torch, torch.nn.functional as F
        kernels = {
            "index_select": (lambda x, i: torch.index_select(x, 0, i) * 2 + 1, (8, 1024), (256,), 8),
            "embedding": (lambda w, i: F.embedding(i, w).sum(-1), (10, 64), (4, 2), 10),
            "gather": (lambda x, i: torch.gather(x, 1, i) + 1, (64, 64), (64, 64), 64),
            "scatter_add": (lambda x, i: x.scatter_add(0, i, torch.ones(i.shape, device=i.device)) * 3, (16, 32),
                            (64, 32), 16),
        }
        for name, (fn, shape, index_shape, n) in kernels.items():
            f = torch.compile(fn, backend="neuron")
            x = torch.randn(shape, device="neuron")
            good = torch.randint(0, n, index_shape, device="neuron")
            for _ in range(3):
                assert torch.allclose(f(x, good).cpu(), fn(x.cpu(), good.cpu())), name
            try:
                f(x, good + n).cpu()
                print(name, "no error")
            except Exception as e:
                print(name, "raised", type(e).__name__, "index out of bounds" in str(e) or "out of bounds" in str(e))
            print(name, "after", torch.allclose(f(x, good).cpu(), fn(x.cpu(), good.cpu())))
        # a check inside a masked load's lambda keeps Inductor's own (no loop to skip to): it still compiles and runs
        pad = lambda x, i: F.pad(torch.index_select(x, 0, i) * 2, (1, 1))
        x, i = torch.randn(8, 64, device="neuron"), torch.randint(0, 8, (32,), device="neuron")
        print("padded", torch.equal(torch.compile(pad, backend="neuron")(x, i).cpu(), pad(x.cpu(), i.cpu())))
        """, env={"OMP_NUM_THREADS": threads}, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-800:]
    for name in ("index_select", "embedding", "gather", "scatter_add"):
        assert f"{name} raised RuntimeError True" in p.stdout and f"{name} after True" in p.stdout, p.stdout
    assert "padded True" in p.stdout, p.stdout


def test_a_forked_child_compiles_a_cpu_function():
    """probes/p21_fork_child_compile.py: the child of a parent that used the device can do any CPU work, including
    torch.compile of a CPU function (was InternalTorchDynamoError "Cannot re-initialize neuron": Dynamo asked
    torch.accelerator for the current stream, which is available no more in such a child)."""
    p = run_py("""
        import os
        import torch
        torch.ones(4, device="neuron").sum().item()
        pid = os.fork()
        if pid == 0:
            try:
                out = torch.compile(lambda t: t * 2 + 1, backend="inductor")(torch.ones(3))
                os._exit(0 if out.tolist() == [3.0, 3.0, 3.0] else 2)
            except Exception:
                os._exit(1)
        _, st = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(st))
        """, timeout=120, check=False)
    assert "child 0" in p.stdout, p.stdout + p.stderr[-500:]


def test_a_pending_failure_is_printed_when_the_exit_drain_times_out():
    """probes/p23_exit_timeout_drops_error.py: the index_select has failed long before exit; a daemon thread keeps
    the stream busy past TORCHNEURON_EXIT_TIMEOUT; stderr must still carry the IndexError (not only the timeout)."""
    p = run_py("""
        import threading, time
        import torch
        src = torch.randn(8, 4, device="neuron")
        torch.index_select(src, 0, torch.tensor([0, 1], device="neuron")) + 1
        x, w = torch.randn(1024, 1024, device="neuron"), torch.randn(1024, 1024, device="neuron") / 32
        for _ in range(6):  # queued work, so that the index_select below queues and fails on the worker
            x = torch.tanh(x @ w)
        bad = torch.index_select(src, 0, torch.tensor([0, 99], device="neuron"))
        time.sleep(1.0)
        def launch_forever():
            x = torch.ones(512, 512, device="neuron")
            while True:
                x = (x @ x).tanh()
        threading.Thread(target=launch_forever, daemon=True).start()
        time.sleep(0.5)
        """, env={"TORCHNEURON_EXIT_TIMEOUT": "2"}, timeout=60, check=False)
    assert p.returncode == 1
    assert "IndexError" in p.stderr and "index_select" in p.stderr, p.stderr[-800:]


@pytest.mark.parametrize("failing", [False, True])
def test_exit_with_a_stream_waiting_for_queued_work_is_prompt(failing):
    """probes/p32_exit_with_waiting_stream.py: the script ends right after side.wait_stream(default) while the
    default stream still has ~0.2 s of work; the drain waits the whole TORCHNEURON_EXIT_TIMEOUT ("did not finish ...
    stream 65", status 1), with no kernel error at all, and a failure behind it is never printed."""
    t0 = time.perf_counter()
    p = run_py(f"""
        import torch
        side = torch.neuron.Stream()
        src = torch.randn(8, 4, device="neuron")
        torch.index_select(src, 0, torch.tensor([0, 1], device="neuron")) + 1
        x, w = torch.randn(1024, 1024, device="neuron"), torch.randn(1024, 1024, device="neuron") / 32
        for _ in range(6):
            x = torch.tanh(x @ w)
        if {failing}:
            bad = torch.index_select(src, 0, torch.tensor([0, 99], device="neuron"))
        side.wait_stream(torch.neuron.current_stream())
        """, env={"TORCHNEURON_EXIT_TIMEOUT": "10"}, timeout=60, check=False)
    assert "did not finish" not in p.stderr, p.stderr[-600:]
    assert time.perf_counter() - t0 < 9
    if failing:
        assert p.returncode == 1 and "index_select" in p.stderr, p.stderr[-600:]
    else:
        assert p.returncode == 0, p.stderr[-600:]


def test_the_launch_queue_is_bounded():
    """probes/p24_unbounded_launch_queue.py: CUDA blocks a launch once about 1,024 are pending, so the host never
    runs more than a bounded amount of work ahead (a later sync point, first call or exit drain would wait behind
    all of it). Behind a closed gate, a thread launching 1,500 kernels stops at the bound, then finishes once the
    gate opens, with the CPU's values."""
    x = torch.zeros(64, device=DEV)
    x.add_(1)  # the signature known: queued below
    torch.neuron.synchronize()
    launched = 0

    def launch() -> None:
        nonlocal launched
        for _ in range(1500):
            x.add_(1)
            launched += 1

    thread = threading.Thread(target=launch, daemon=True)
    with Gate():
        thread.start()
        thread.join(timeout=5)  # it waits at the bound while the gate holds the stream
        assert thread.is_alive() and launched <= 1024, launched
    thread.join(timeout=120)
    assert not thread.is_alive() and launched == 1500
    assert torch.equal(x.cpu(), torch.full((64,), 1501.0))

