"""Every torch.distributed collective on `neuron` tensors (backend "neuron") against gloo on CPU tensors,
with 2 and 4 processes: each case runs once on neuron through the neuron group and once on CPU through a gloo
group, and the results must be identical. (gloo has no AVG or PREMUL_SUM: its reference is SUM, scaled.)"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from dist_helpers import init, launch

pytestmark = pytest.mark.slow
R = dist.ReduceOp


@dataclass
class Ctx:
    dev: torch.device
    g: Any  # the world group: neuron, or gloo for the reference
    sub: Any  # a subgroup of ranks {0, n-1}
    r: int
    n: int
    ref: bool

    def x(self, *shape: int, dtype: torch.dtype = torch.float32, k: int = 1) -> torch.Tensor:
        """A tensor that differs per rank and per `k`, the same in both runs."""
        numel = 1
        for s in shape:
            numel *= s
        return ((torch.arange(numel) % 7 + 3 * self.r + k).reshape(shape).to(dtype)).to(self.dev)


CASES: dict[str, Callable[[Ctx], Any]] = {}


def case(fn: Callable[[Ctx], Any]) -> Callable[[Ctx], Any]:
    CASES[fn.__name__] = fn
    return fn


def _all_reduce(op: Any, dtype: torch.dtype) -> Callable[[Ctx], Any]:
    def run(c: Ctx) -> Any:
        t = c.x(5, 3, dtype=dtype)
        if c.ref and op == R.AVG:
            dist.all_reduce(t, group=c.g)
            return t / c.n if t.is_floating_point() else t.div(c.n, rounding_mode="trunc")  # NCCL's AVG
        if c.ref and op == "premul":
            t.mul_(0.5)
            dist.all_reduce(t, group=c.g)
            return t
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5) if op == "premul" else op, group=c.g)
        return t
    return run


for _op, _dtype in [(R.SUM, torch.float32), (R.AVG, torch.float32), (R.PRODUCT, torch.float32),
                    (R.MIN, torch.float32), (R.MAX, torch.float32), ("premul", torch.float32),
                    (R.BAND, torch.int32), (R.BOR, torch.int32), (R.BXOR, torch.int32), (R.MAX, torch.int32),
                    (R.AVG, torch.int32), (R.SUM, torch.bfloat16)]:
    _name = _op if isinstance(_op, str) else str(_op).split(".")[-1].lower()
    CASES[f"all_reduce_{_name}_{str(_dtype)[6:]}"] = _all_reduce(_op, _dtype)


@case
def all_reduce_async(c: Ctx) -> Any:
    t = c.x(64)
    work = dist.all_reduce(t, async_op=True, group=c.g)
    fut = work.get_future()
    assert work.wait() and work.is_completed()
    value = fut.wait()
    assert value[0].device == c.dev, value  # DDP's reducer reads the bucket back from the future
    return t


@case
def all_reduce_view(c: Ctx) -> Any:
    base = c.x(4, 6)
    dist.all_reduce(base[1:3], group=c.g)  # a view with a storage offset: only those rows change
    return base


@case
def temporary_inputs(c: Ctx) -> Any:
    """Async collectives whose input dies at once: the group must keep its memory until gloo has read it."""
    outs = []
    for k in range(3):
        out, rs = torch.empty(c.n << 18, device=c.dev), torch.empty(1 << 18, device=c.dev)
        works = [dist.all_gather_into_tensor(out, c.x(1 << 18, k=k) * 1, group=c.g, async_op=True),
                 dist.reduce_scatter_tensor(rs, c.x(c.n << 18, k=k) * 1, group=c.g, async_op=True)]
        junk = [torch.full((c.n << 18,), -1.0, device=c.dev) for _ in range(4)]  # would reuse freed memory
        for w in works:
            w.wait()
        outs += [out, rs]
        del junk
    return outs


@case
def broadcast(c: Ctx) -> Any:
    a, b = c.x(3, 4), c.x(7, dtype=torch.int32)
    dist.broadcast(a, 0, group=c.g)
    dist.broadcast(b, c.n - 1, group=c.g)
    return a, b


@case
def reduce(c: Ctx) -> Any:
    t, m = c.x(6), c.x(6, k=2)
    dist.reduce(t, 1, group=c.g)
    dist.reduce(m, 0, op=R.MAX, group=c.g)
    return (t if c.r == 1 else None), (m if c.r == 0 else None)  # other ranks' buffers are unspecified


@case
def all_gather(c: Ctx) -> Any:
    out = [torch.empty(2, 3, device=c.dev) for _ in range(c.n)]
    dist.all_gather(out, c.x(2, 3), group=c.g)
    return out


@case
def all_gather_into_tensor(c: Ctx) -> Any:
    out = torch.empty(c.n * 4, 2, device=c.dev)
    dist.all_gather_into_tensor(out, c.x(4, 2), group=c.g)
    return out


@case
def all_gather_object(c: Ctx) -> Any:
    objs: list[Any] = [None] * c.n
    dist.all_gather_object(objs, {"rank": c.r, "tail": [c.r] * c.r, "t": c.x(2).cpu()}, group=c.g)
    return objs


@case
def reduce_scatter(c: Ctx) -> Any:
    out = torch.empty(3, device=c.dev)
    dist.reduce_scatter(out, [c.x(3, k=j) for j in range(c.n)], group=c.g)
    return out


@case
def reduce_scatter_tensor(c: Ctx) -> Any:
    out, avg = torch.empty(2, 3, device=c.dev), torch.empty(2, 3, device=c.dev)
    dist.reduce_scatter_tensor(out, c.x(2 * c.n, 3), group=c.g)
    if c.ref:
        dist.reduce_scatter_tensor(avg, c.x(2 * c.n, 3, k=2), group=c.g)
        avg /= c.n
    else:
        dist.reduce_scatter_tensor(avg, c.x(2 * c.n, 3, k=2), op=R.AVG, group=c.g)
    return out, avg


@case
def all_to_all(c: Ctx) -> Any:
    ins = [c.x(c.r + j + 1, k=j) for j in range(c.n)]  # uneven: rank r sends r+j+1 elements to rank j
    outs = [torch.empty(j + c.r + 1, device=c.dev) for j in range(c.n)]
    if c.ref:  # gloo's own all_to_all takes equal sizes only: the reference packs into all_to_all_single
        packed = torch.empty(sum(o.numel() for o in outs))
        sizes = [o.numel() for o in outs], [i.numel() for i in ins]
        dist.all_to_all_single(packed, torch.cat(ins), *sizes, group=c.g)
        return list(packed.split([o.numel() for o in outs]))
    dist.all_to_all(outs, ins, group=c.g)
    return outs


@case
def all_to_all_single(c: Ctx) -> Any:
    out = torch.empty(c.n * 2, 3, device=c.dev)
    dist.all_to_all_single(out, c.x(c.n * 2, 3), group=c.g)
    return out


@case
def all_to_all_single_uneven(c: Ctx) -> Any:
    send = [c.r + j + 1 for j in range(c.n)]  # rows rank r sends to rank j
    recv = [j + c.r + 1 for j in range(c.n)]
    out = torch.empty(sum(recv), 2, device=c.dev)
    dist.all_to_all_single(out, c.x(sum(send), 2), recv, send, group=c.g)
    return out


@case
def gather(c: Ctx) -> Any:
    dst = c.n - 1
    out = [torch.empty(5, device=c.dev) for _ in range(c.n)] if c.r == dst else None
    dist.gather(c.x(5), out, dst=dst, group=c.g)
    return out


@case
def scatter(c: Ctx) -> Any:
    out = torch.empty(4, device=c.dev)
    dist.scatter(out, [c.x(4, k=j) for j in range(c.n)] if c.r == 0 else None, src=0, group=c.g)
    return out


@case
def barrier(c: Ctx) -> Any:
    dist.barrier(group=c.g)
    if c.sub is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.barrier(group=c.sub)
    dist.barrier(group=c.g, async_op=True).wait()
    return True


@case
def send_recv(c: Ctx) -> Any:
    t = c.x(6)
    if c.r % 2 == 0 and c.r + 1 < c.n:
        dist.send(t, c.r + 1, group=c.g)
    elif c.r % 2 == 1:
        dist.recv(t, c.r - 1, group=c.g)
    return t


@case
def isend_irecv_ring(c: Ctx) -> Any:
    out = torch.empty(4, device=c.dev)
    works = [dist.isend(c.x(4), (c.r + 1) % c.n, group=c.g), dist.irecv(out, (c.r - 1) % c.n, group=c.g)]
    for w in works:
        w.wait()
    return out


@case
def batch_isend_irecv(c: Ctx) -> Any:
    out = torch.empty(3, device=c.dev)
    ops = [dist.P2POp(dist.isend, c.x(3), (c.r + 1) % c.n, c.g),
           dist.P2POp(dist.irecv, out, (c.r - 1) % c.n, c.g)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


@case
def recv_any_source(c: Ctx) -> Any:
    t, src = c.x(2), None
    if c.r == 1:
        dist.send(t, 0, group=c.g)
    elif c.r == 0:
        src = dist.recv(t, group=c.g)
    return t, src


@case
def coalesced(c: Ctx) -> Any:
    """The fast paths of `_coalescing_manager` (DDP/FSDP-style bucketed collectives)."""
    ts = [c.x(3), c.x(2, 2, k=2)]
    with dist._coalescing_manager(group=c.g, async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, group=c.g)
    cm.wait()
    ag = [torch.empty(c.n * 2, device=c.dev), torch.empty(c.n * 3, device=c.dev)]
    with dist._coalescing_manager(group=c.g):
        for o, i in zip(ag, [c.x(2), c.x(3, k=4)], strict=True):
            dist.all_gather_into_tensor(o, i, group=c.g)
    rs = [torch.empty(2, device=c.dev), torch.empty(1, device=c.dev)]
    with dist._coalescing_manager(group=c.g):
        for o, i in zip(rs, [c.x(2 * c.n), c.x(c.n, k=5)], strict=True):
            dist.reduce_scatter_tensor(o, i, group=c.g)
    return ts, ag, rs


@case
def new_group(c: Ctx) -> Any:
    if c.sub is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    t = c.x(4)
    dist.all_reduce(t, group=c.sub)
    out = [torch.empty(2, device=c.dev) for _ in range(2)]
    dist.all_gather(out, c.x(2), group=c.sub)
    return t, out, dist.get_group_rank(c.sub, c.r)


@case
def functional(c: Ctx) -> Any:
    """torch.distributed._functional_collectives in eager (what DTensor and traced graphs call)."""
    send = [c.r + j + 1 for j in range(c.n)]
    recv = [j + c.r + 1 for j in range(c.n)]
    res = [fc.all_reduce(c.x(4), "sum", c.g), fc.all_reduce(c.x(4), "max", c.g),
           fc.all_gather_tensor(c.x(2, 2), 0, c.g), fc.reduce_scatter_tensor(c.x(c.n * 2), "sum", 0, c.g),
           fc.all_to_all_single(c.x(sum(send)), recv, send, c.g), fc.broadcast(c.x(3), 0, c.g),
           *fc.all_reduce_coalesced([c.x(2), c.x(3, k=3)], "sum", c.g)]
    return [fc.wait_tensor(t) if isinstance(t, fc.AsyncCollectiveTensor) else t for t in res]


def run_cases() -> dict[str, Any]:
    """Per rank: each case on neuron (neuron group) and on CPU (gloo group); returns {name: (neuron, cpu)}."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames a few collectives
    r, n = init()
    neuron = Ctx(torch.device("neuron", torch.neuron.current_device()), dist.group.WORLD,
                 dist.new_group([0, n - 1]), r, n, False)
    cpu = Ctx(torch.device("cpu"), dist.new_group(backend="gloo"), dist.new_group([0, n - 1], backend="gloo"),
              r, n, True)
    out = {name: (fn(neuron), fn(cpu)) for name, fn in CASES.items()}
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}procs")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return launch("test_distributed_collectives.py::run_cases", request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_collective_matches_gloo(results: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(results):
        got, want = res[name]
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, r=rank: f"rank {r}: {m}")

