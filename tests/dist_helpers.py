"""Helpers for the distributed tests: run a test function on N ranks (torchrun's environment, or torchrun
itself), a tiny GPT with its data, and two network-namespace "hosts".

Run as a script it is the per-rank entry point: `python tests/dist_helpers.py FILE::FUNC OUTDIR` calls
FUNC(*args) from FILE (args pickled in OUTDIR/args.pkl) and pickles the rank's result to OUTDIR/rank<R>.pkl.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from helpers import clean_env, to_cpu_tree

HERE = Path(__file__).resolve().parent
TIMEOUT = 180  # seconds for a whole multi-process run; each process group gets far less


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: Any) -> dict[str, str]:
    """The environment of a rank: ours minus device configuration, one thread, plus `extra`."""
    return clean_env(("LOCAL_",), **{"OMP_NUM_THREADS": "1", "TORCHNEURON_FALLBACK": "silent", "PYTHONUNBUFFERED": "1",
                                     **extra})


class RankFailed(AssertionError):
    pass


def _collect(procs: list[subprocess.Popen], logs: list[Path], outdir: Path, timeout: float,
             allow_fail: tuple[int, ...]) -> list[Any]:
    deadline, timed_out = time.monotonic() + timeout, False
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for p in procs:  # each rank runs in its own session: end it and anything it started
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    bad = [i for i, p in enumerate(procs) if p.returncode != 0 and i not in allow_fail]
    if timed_out or bad:
        tails = "\n".join(f"--- process {i} (exit {procs[i].returncode}):\n{logs[i].read_text()[-3000:]}"
                          for i in range(len(procs)))
        what = f"timed out after {timeout}s" if timed_out else f"processes {bad} failed"
        raise RankFailed(f"{what}\n{tails}")
    files = sorted(outdir.glob("rank*.pkl"), key=lambda f: int(f.stem[4:]))
    results: dict[int, Any] = {int(f.stem[4:]): pickle.loads(f.read_bytes()) for f in files}
    return [results.get(r) for r in range(max(results, default=-1) + 1)]


def launch(target: str, nprocs: int, *args: Any, torchrun: bool = False, timeout: float = TIMEOUT,
           env: dict[str, Any] | None = None, allow_fail: tuple[int, ...] = ()) -> list[Any]:
    """Run `target` ("test_file.py::func") on `nprocs` ranks and return each rank's result (None where a rank
    in `allow_fail` died). Ranks get torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT);
    with torchrun=True, torchrun itself starts them."""
    outdir = Path(tempfile.mkdtemp(prefix="tn-dist-"))
    try:
        (outdir / "args.pkl").write_bytes(pickle.dumps(args))
        port = free_port()
        file, func = target.split("::")
        entry = [str(HERE / "dist_helpers.py"), f"{HERE / file}::{func}", str(outdir)]
        if torchrun:
            cmds = [[sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
                     f"--master-port={port}", "--max-restarts=0", *entry]]
            envs = [child_env(**(env or {}))]
        else:
            cmds = [[sys.executable, *entry]] * nprocs
            envs = [child_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=nprocs, LOCAL_WORLD_SIZE=nprocs,
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **(env or {}))
                    for r in range(nprocs)]
        return run_commands(cmds, envs, outdir, timeout, allow_fail)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def run_commands(cmds: list[list[str]], envs: list[dict[str, str]], outdir: Path, timeout: float,
                 allow_fail: tuple[int, ...] = ()) -> list[Any]:
    logs = [outdir / f"log{i}.txt" for i in range(len(cmds))]
    procs = []
    for cmd, env, log in zip(cmds, envs, logs, strict=True):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=HERE.parent,
                                          start_new_session=True))
    return _collect(procs, logs, outdir, timeout, allow_fail)


def init(timeout: float = 60, **kwargs: Any) -> tuple[int, int]:
    """init_process_group(backend="neuron") from torchrun's variables; returns (rank, world size)."""
    import torch.distributed as dist

    kwargs.setdefault("backend", "neuron")
    dist.init_process_group(timeout=datetime.timedelta(seconds=timeout), **kwargs)
    return dist.get_rank(), dist.get_world_size()


# ---- a tiny GPT and its data ----

def tiny_gpt(seed: int = 0, vocab: int = 64, block: int = 16, d: int = 32, heads: int = 2, layers: int = 2):
    """torchneuron.models.TinyGPT without dropout, built on the CPU from `seed` (every process builds the same
    weights)."""
    import torch

    from torchneuron.models import GPTConfig, TinyGPT

    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab_size=vocab, block_size=block, n_layer=layers, n_head=heads, n_embd=d, dropout=0.0))


def batches(steps: int, batch: int = 8, block: int = 16, vocab: int = 64, seed: int = 1):
    """`steps` global batches (inputs, targets), the same in every process: runs of consecutive tokens from
    random starts, so the next token is learnable and the loss falls within a few steps."""
    import torch

    g = torch.Generator().manual_seed(seed)
    data = (torch.randint(vocab, (steps, batch, 1), generator=g) + torch.arange(block + 1)) % vocab
    return [(x[:, :-1], x[:, 1:]) for x in data]


def train_losses(model, data, device, shard: tuple[int, int] = (0, 1), reduce=None, lr: float = 0.1) -> list:
    """SGD on `data`; each rank trains on its `shard` (rank, world) of every global batch, and `reduce` turns
    the local loss into the global one (an all_reduce average) to compare with single-process training."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rank, world = shard
    losses = []
    for x, y in data:
        n = len(x) // world
        _, loss = model(x[rank * n:(rank + 1) * n].to(device), y[rank * n:(rank + 1) * n].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        losses.append((reduce(loss) if reduce else loss).item())
    return losses


# ---- two "hosts" as network namespaces ----

@contextlib.contextmanager
def two_hosts(prefix: str = "tn") -> Iterator[list[tuple[str, str, str]]]:
    """Two network namespaces joined by a veth pair: yields [(namespace, address, interface)] for each host.
    Raises PermissionError where the sandbox forbids creating them."""
    if shutil.which("ip") is None:
        raise PermissionError("iproute2 (`ip`) is not installed")
    tag = f"{prefix}{os.getpid() % 100000}"
    hosts = [(f"{tag}a", "10.231.7.1", f"{tag}va"), (f"{tag}b", "10.231.7.2", f"{tag}vb")]
    steps = [["netns", "add", hosts[0][0]], ["netns", "add", hosts[1][0]],
             ["link", "add", hosts[0][2], "type", "veth", "peer", "name", hosts[1][2]]]
    for ns, addr, dev in hosts:
        steps += [["link", "set", dev, "netns", ns], ["-n", ns, "addr", "add", f"{addr}/24", "dev", dev],
                  ["-n", ns, "link", "set", dev, "up"], ["-n", ns, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            p = subprocess.run(["ip", *step], capture_output=True, text=True)
            if p.returncode:
                raise PermissionError(f"`ip {' '.join(step)}` failed: {p.stderr.strip()}")
        yield hosts
    finally:
        for ns, _, _ in hosts:  # deleting a namespace also removes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _main() -> None:
    file, func = sys.argv[1].split("::")
    outdir = Path(sys.argv[2])
    spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = getattr(module, func)(*pickle.loads((outdir / "args.pkl").read_bytes()))
    (outdir / f"rank{os.environ['RANK']}.pkl").write_bytes(pickle.dumps(to_cpu_tree(result)))


if __name__ == "__main__":
    _main()
