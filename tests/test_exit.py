"""Interpreter exit with work queued (issue 26, item 6; docs/device.md, "Exit"): each case is a script run to its
end in its own interpreter, under a timeout."""
from __future__ import annotations

from tests.conftest import run_py

SLOW = """
import torch

def slow(n=8, size=1024):  # queued matmuls: what is launched after them really queues
    a = torch.randn(size, size, device="neuron")
    for _ in range(n):
        a @ a
"""


def run(code: str, **env: str):
    return run_py(SLOW + code, env=env, timeout=240, check=False)


def test_a_kernel_error_pending_at_exit_is_printed_and_fails_the_exit():
    code = """
x = torch.randn(300000, device="neuron")
good, bad = torch.tensor([0, 1], device="neuron"), torch.tensor([0, 10**9], device="neuron")
x.index_select(0, good)  # the signature's first call runs at once; the next is queued
slow()
y = x.index_select(0, bad)  # fails on the worker; nothing syncs before the end
print("launched")
"""
    line = (SLOW + code).splitlines().index("y = x.index_select(0, bad)  # fails on the worker; nothing syncs "
                                            "before the end") + 1
    p = run(code)
    assert p.returncode == 1, p.stderr
    assert p.stdout == "launched\n"
    assert "a queued kernel failed and its error was still pending at exit" in p.stderr
    assert "IndexError" in p.stderr and "aten::index_select" in p.stderr
    assert f'File "<string>", line {line}' in p.stderr  # the launching line, as the sync point reports it


def test_a_clean_script_exits_zero_and_quiet():
    p = run("""
x = torch.randn(300000, device="neuron")
slow()
y = (x * 2).sum()  # queued behind slow(); drained at exit
print("done")
""")
    assert (p.returncode, p.stdout, p.stderr) == (0, "done\n", "")


def test_a_daemon_thread_launching_at_exit_is_stopped_and_the_exit_completes():
    """The daemon thread's backlog stays short (it reads a value each round): the drain finishes it and the thread's
    next device use never returns (raising there aborted the process in CPython's finalization 2 runs in 10). The
    drain does not wait for the parked thread: a thread parked inside its launch once counted as a launch in
    progress, and about one exit in four took the whole TORCHNEURON_EXIT_TIMEOUT (here far above the run's limit)."""
    for _ in range(5):
        p = run_py(SLOW + """
import threading
going = threading.Event()
def loop():
    a = torch.randn(512, 512, device="neuron")
    while True:
        a = (a @ a).tanh()
        a.sum().item()
        going.set()
threading.Thread(target=loop, daemon=True).start()
going.wait()
print("exiting")
""", env={"TORCHNEURON_EXIT_TIMEOUT": "600"}, timeout=120, check=False)
        assert (p.returncode, p.stdout, p.stderr) == (0, "exiting\n", "")


def test_the_exiting_threads_later_launches_run_at_the_call():
    """An atexit handler registered before torch was imported runs after the drain, on the exiting thread: its
    device work runs at the call (nothing is queued after the drain)."""
    p = run_py("""
import atexit

def late():
    print((torch.ones(3, device="neuron") * 2).sum().item(), torch.neuron.is_initialized())
atexit.register(late)

import torch
torch.ones(1, device="neuron")
""", timeout=240, check=False)
    assert (p.returncode, p.stdout, p.stderr) == (0, "6.0 True\n", "")


def test_the_exit_drain_is_bounded():
    """A daemon thread queues far more work than the bound allows: the drain names the busy stream and the process
    ends with status 1 instead of waiting."""
    p = run("""
import threading
queued = threading.Event()
def loop():
    a = torch.randn(2048, 2048, device="neuron")
    for i in range(10**9):
        a @ a
        if i == 50:
            queued.set()
threading.Thread(target=loop, daemon=True).start()
queued.wait()
print("exiting")
""", TORCHNEURON_EXIT_TIMEOUT="0.3")
    assert p.returncode == 1, p.stderr
    assert p.stdout == "exiting\n"
    assert "queued work did not finish within 0.3 s at exit (TORCHNEURON_EXIT_TIMEOUT) on neuron:0 stream 0" in p.stderr
