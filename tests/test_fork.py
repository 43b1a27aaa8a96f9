"""fork and the device (issue 26, item 5; docs/device.md, "Fork"). Each case runs in its own interpreter under a
timeout, and every fork waits for its child with a deadline, killing it on expiry: a hang fails the test, never the
suite."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from helpers import clean_env

from tests.conftest import run_py

# Shared by the scripts: fork a child running `body` (it writes a JSON line to `out`), wait at most 60 s.
FORK = """
import json, os, signal, threading, torch

def in_child(body):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        with os.fdopen(w, "w") as out:
            try:
                body(out)
            except BaseException as e:
                out.write(json.dumps({"child raised": repr(e)}) + "\\n")
        os._exit(0)
    os.close(w)
    waiter = threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True)
    waiter.start()
    waiter.join(60)
    if not waiter.is_alive():
        with os.fdopen(r) as f:
            return json.loads(f.read() or "null")
    os.kill(pid, signal.SIGKILL)
    waiter.join()
    return "hung"

def slow():  # ~0.2 s of queued matmuls: what is launched after them really queues
    a = torch.randn(1024, 1024, device="neuron")
    for _ in range(8):
        a @ a
"""


def result(code: str, env: dict | None = None):
    p = run_py(FORK + textwrap.dedent(code), env=env, timeout=300)
    return json.loads(p.stdout.strip().splitlines()[-1])


def cpu_matmul_in_child(parent: str):
    """`parent` runs, then a forked child multiplies two seeded 256x256 CPU matrices; their sum, and the parent's."""
    return result(parent + """
def body(out):
    torch.manual_seed(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out.write(json.dumps((a @ b).double().sum().item()))
child = in_child(body)
torch.manual_seed(1)
a, b = torch.randn(256, 256), torch.randn(256, 256)
print(json.dumps([child, (a @ b).double().sum().item()]))
""")


def test_child_runs_cpu_work_after_the_parent_used_the_device():
    """The issue's hang: a 1024x1024 matmul's first call runs on the parent's thread with its OpenMP team, whose
    bookkeeping (not its threads) a forked child inherited; the child's first parallel kernel waited for them."""
    child, parent = cpu_matmul_in_child("""
x = torch.randn(1024, 1024, device="neuron")
for _ in range(4):
    x = (x @ x).tanh()
torch.neuron.synchronize()
""")
    assert child == parent


def test_child_runs_cpu_work_after_a_parallel_cpu_kernel_and_with_work_queued():
    """A parent's own parallel CPU kernel left the same state (plain PyTorch's children hang on it too), and work
    still queued at the fork is drained by the before-fork hook."""
    child, parent = cpu_matmul_in_child("""
torch.randn(512, 512) @ torch.randn(512, 512)
slow()
""")
    assert child == parent


def test_child_runs_a_cpu_convolution_after_the_parent_queued_convolutions():
    """Queued convolutions make their results in device memory the CPU allocator hands them (docs/device.md), and
    oneDNN's scratch goes through that allocator's raw deleter, which keeps a record under a lock: a child forked
    right after them has a fresh record and lock, so its own convolution (oneDNN's scratch again) finishes and
    equals the parent's, and the parent's queued results equal the CPU's."""
    out = result("""
torch.manual_seed(0)
x, w = torch.randn(8, 16, 32, 32), torch.randn(32, 16, 3, 3)
xd, wd = x.to("neuron"), w.to("neuron")
ys = []
for _ in range(6):
    slow()
    ys.append(torch.nn.functional.conv2d(xd, wd, padding=1))
def body(out):
    out.write(json.dumps(torch.nn.functional.conv2d(x, w, padding=1).double().sum().item()))
child = in_child(body)
ref = torch.nn.functional.conv2d(x, w, padding=1)
print(json.dumps([child, ref.double().sum().item(), all(torch.allclose(y.cpu(), ref, atol=1e-4) for y in ys)]))
""")
    assert out[2] is True and out[0] == out[1]


def test_a_fork_during_a_fusion_compile_that_takes_file_locks_finishes():
    """pytorch/examples' mnist (DataLoader workers) hung at its second epoch's fork: the fork waited for the eager
    fusion compile in progress, which waited at filelock's fork gate (Inductor takes file locks), closed by
    filelock's own fork hook. The wait now runs first and ends when the compile does (a stand-in compile taking file
    locks for 2 s here), well inside its FORK_WAIT bound."""
    p = run_py(FORK + textwrap.dedent("""
        import filelock, tempfile, time
        from torchneuron.compiler import eager_fusion as ef
        signal.alarm(100)  # a hang ends the script (the fork itself would never return)
        started = threading.Event()
        def compile_key(key, nodes, mutations):
            lock = filelock.FileLock(os.path.join(tempfile.mkdtemp(), "x.lock"))
            started.set()
            end = time.time() + 2
            while time.time() < end:
                with lock:
                    pass
        ef._compile_key = compile_key
        ef._BACKGROUND.submit(("stand-in",), (), ())
        started.wait(30)
        t0 = time.time()
        child = in_child(lambda out: out.write(json.dumps("ok")))
        print(json.dumps([child, time.time() - t0 < ef.FORK_WAIT]))
        """), timeout=150)
    assert json.loads(p.stdout.strip().splitlines()[-1]) == ["ok", True]


def test_a_child_forked_without_waiting_for_a_long_compile_can_compile():
    """A compile longer than FORK_WAIT: the fork goes ahead, and the child, where the compiler thread does not
    exist, gets a free Dynamo compile lock and Inductor's settings as they are outside a fusion compile; the next
    fork does not wait for the same compile again."""
    p = run_py(FORK + textwrap.dedent("""
        import time
        import torch._inductor.config as inductor_config
        from torch._dynamo import convert_frame
        from torchneuron.compiler import eager_fusion as ef
        signal.alarm(100)
        ef.FORK_WAIT = 2.0
        started = threading.Event()
        def compile_key(key, nodes, mutations):  # stands in for a long Inductor compile
            ef._SETTINGS_BEFORE.update({n: getattr(inductor_config, n) for n in ef._COMPILE_SETTINGS})
            with inductor_config.patch(**ef._COMPILE_SETTINGS):
                started.set()
                time.sleep(8)
        ef._compile_key = compile_key
        ef._BACKGROUND.submit(("long",), (), ())
        started.wait(30)
        def body(out):
            free = convert_frame.compile_lock.acquire(blocking=False)
            out.write(json.dumps([free, inductor_config.size_asserts]))
        t0 = time.time()
        first = in_child(body)
        t1 = time.time()
        second = in_child(body)
        print(json.dumps([first, second, 2.0 <= t1 - t0 < 6, time.time() - t1 < 1.5]))
        """), timeout=150)
    first, second, waited_once, not_again = json.loads(p.stdout.strip().splitlines()[-1])
    assert first == second == [True, True] and waited_once and not_again


def test_device_use_in_the_child_raises_cudas_error():
    out = result("""
x = torch.arange(4.0, device="neuron")
slow()

def body(out):
    uses = {
        "factory": lambda: torch.ones(2, device="neuron"),
        "to": lambda: torch.ones(2).to("neuron"),
        "op": lambda: x + 1,
        "read": lambda: x.cpu(),
        "synchronize": torch.neuron.synchronize,
        "accelerator synchronize": torch.accelerator.synchronize,
        "stream": torch.neuron.Stream,
        "current stream": torch.neuron.current_stream,
    }
    seen = {}
    for name, use in uses.items():
        try:
            use()
            seen[name] = "no error"
        except Exception as e:
            seen[name] = [type(e).__name__, str(e).splitlines()[0]]
    torch.manual_seed(0)  # what a DataLoader worker does: PyTorch skips a device in a bad fork
    cpu = (torch.arange(4.0) * 2).tolist()
    available = [torch.neuron.is_available(), torch.accelerator.is_available()]  # code that checks goes to the CPU
    out.write(json.dumps([seen, torch.neuron._is_in_bad_fork(), torch.neuron.is_initialized(), cpu, available]))

child = in_child(body)
print(json.dumps([child, torch.neuron._is_in_bad_fork(), (x * 2).cpu().tolist()]))
""")
    child, parent_bad_fork, parent_value = out
    assert child != "hung"
    seen, bad_fork, initialized, cpu, available = child
    assert available == [False, False]
    message = ("Cannot re-initialize neuron in forked subprocess. To use neuron with multiprocessing, you must use "
               "the 'spawn' start method")
    assert seen == {name: ["RuntimeError", message] for name in seen}
    assert bad_fork is True and initialized is False and cpu == [0.0, 2.0, 4.0, 6.0]
    assert parent_bad_fork is False and parent_value == [0.0, 2.0, 4.0, 6.0]  # the parent carries on


def test_a_parent_that_never_used_the_device_forks_freely():
    out = result("""
def body(out):
    out.write(json.dumps([torch.neuron._is_in_bad_fork(), torch.accelerator.is_available(),
                          (torch.arange(4.0, device="neuron") * 2).cpu().tolist()]))
print(json.dumps(in_child(body)))
""")
    assert out == [False, True, [0.0, 2.0, 4.0, 6.0]]


def test_a_pending_error_stays_pending_for_the_parent():
    """The before-fork drain raises nothing: the failed kernel's error is the parent's, at its next sync point."""
    out = result("""
x = torch.randn(300000, device="neuron")
x.index_select(0, torch.tensor([0, 1], device="neuron"))  # the signature's first call runs at once
slow()
bad = x.index_select(0, torch.tensor([0, 10**9], device="neuron"))  # queued: fails on the worker
def body(out):
    out.write(json.dumps((torch.arange(3.0) + 1).tolist()))
child = in_child(body)
try:
    torch.neuron.synchronize()
    print(json.dumps([child, "no error"]))
except IndexError as e:
    print(json.dumps([child, "index_select" in str(e)]))
""")
    assert out == [[1.0, 2.0, 3.0], True]


LOADER = """
import pickle, sys, torch
from torch.utils.data import DataLoader, Dataset

class Rows(Dataset):
    def __init__(self, rows, pickled=None):
        self.rows, self.pickled = rows, pickled
    def __len__(self):
        return 8
    def __getitem__(self, i):
        if self.pickled is not None:  # a neuron tensor pickled by value, loaded in a spawned worker
            return pickle.loads(self.pickled)[i].cpu()
        return self.rows[i]

def slow():
    a = torch.randn(1024, 1024, device="neuron")
    for _ in range(8):
        a @ a

def batches(dataset, ctx):
    return torch.cat(list(DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context=ctx,
                                     timeout=120)))

def rows_behind_slow(src):
    slow()
    rows = torch.empty(8, pin_memory=True)
    rows.copy_(src * 3 + 1, non_blocking=True)  # queued behind slow(): the host reads garbage until a sync
    return rows

if __name__ == "__main__":
    expected = torch.arange(8.0) * 3 + 1  # the CPU's value of what the device computes below
    src = torch.arange(8.0, device="neuron")
    for _ in range(2):  # each signature's first calls run at once, after the queue: learnt, nothing waits below
        rows_behind_slow(src)
        torch.neuron.synchronize()
    for ctx in ("fork", "spawn"):
        print(ctx, "pinned rows", torch.equal(batches(Rows(rows_behind_slow(src)), ctx), expected))
    slow()
    pickled = pickle.dumps(src * 3 + 1)  # no sync: pickling reads the values
    print("spawn pickled", torch.equal(batches(Rows(None, pickled), "spawn"), expected))
"""


def test_dataloader_workers_see_finished_memory(tmp_path):
    """A dataset of CPU rows written by a queued device-to-host copy, right before the loader starts: fork workers
    copy memory at the fork (drained before it), spawn workers get the rows pickled (drained before sharing);
    and a neuron tensor pickled by value for spawned workers, which may use the device."""
    (tmp_path / "loader.py").write_text(LOADER)  # a file: spawned workers re-import it
    env = clean_env()
    p = subprocess.run([sys.executable, str(tmp_path / "loader.py")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.stdout.split("\n")[:3] == ["fork pinned rows True", "spawn pinned rows True", "spawn pickled True"], (
        p.stdout + p.stderr[-3000:])
