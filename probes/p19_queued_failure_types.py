"""Each kernel that fails on the worker (queued behind slow work, its signature known) raises at the next sync
point with the CPU's exception type and message; its result stays poisoned; a dependent result too."""
import torch
import torch.nn.functional as F
from _pc import DEV, check, done, drain, slow


def mk(dev):
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g).to(dev)

CASES = [  # name, fn(src, dev, bad: bool)
    ("index_select", lambda s, d, b: torch.index_select(s, 0, torch.tensor([0, 99 if b else 1], device=d))),
    ("embedding", lambda s, d, b: F.embedding(torch.tensor([99 if b else 1] * 4, device=d), s)),
    ("gather", lambda s, d, b: torch.gather(s, 0, torch.full((2, 4), 99 if b else 1, device=d))),
    ("scatter", lambda s, d, b: torch.scatter(s, 0, torch.full((2, 4), 99 if b else 1, device=d), 1.0)),
    ("index_add", lambda s, d, b: torch.index_add(s, 0, torch.tensor([99 if b else 1], device=d), torch.ones(1, 4, device=d))),
    ("index_copy", lambda s, d, b: torch.index_copy(s, 0, torch.tensor([99 if b else 1], device=d), torch.ones(1, 4, device=d))),
    ("index_fill", lambda s, d, b: torch.index_fill(s, 0, torch.tensor([99 if b else 1], device=d), 1.0)),
    ("take", lambda s, d, b: torch.take(s, torch.tensor([99 if b else 1], device=d))),
    ("adv index", lambda s, d, b: s[torch.tensor([0, 99 if b else 1], device=d)]),
    ("index_put", lambda s, d, b: torch.index_put(s, (torch.tensor([99 if b else 1], device=d),), torch.ones(4, device=d))),
    ("nll_loss", lambda s, d, b: F.nll_loss(s.log_softmax(1), torch.tensor([9 if b else 1] * 8, device=d))),
    ("cross_entropy", lambda s, d, b: F.cross_entropy(s, torch.tensor([9 if b else 1] * 8, device=d))),
    ("int floordiv", lambda s, d, b: torch.ones(4, dtype=torch.int64, device=d) // torch.tensor([1, 1, 0 if b else 1, 1], device=d)),
    ("int remainder", lambda s, d, b: torch.ones(4, dtype=torch.int64, device=d) % torch.tensor([1, 1, 0 if b else 1, 1], device=d)),
    ("multinomial", lambda s, d, b: torch.multinomial(torch.tensor([-1.0 if b else 1.0, 2.0], device=d), 1)),
    ("one_hot", lambda s, d, b: F.one_hot(torch.tensor([0, 9 if b else 1], device=d), 4)),
    ("embedding_bag", lambda s, d, b: F.embedding_bag(torch.tensor([0, 99 if b else 1], device=d), s, torch.tensor([0], device=d))),
    ("max_unpool", lambda s, d, b: F.max_unpool1d(torch.ones(1, 1, 2, device=d), torch.tensor([[[0, 99 if b else 1]]], device=d), 2)),
    ("bincount", lambda s, d, b: torch.bincount(torch.tensor([0, -1 if b else 1], device=d))),
    ("searchsorted", lambda s, d, b: torch.searchsorted(torch.tensor([1.0, 2.0], device=d), torch.ones(2, device=d), sorter=torch.tensor([0, 9 if b else 1], device=d))),
    ("cholesky", lambda s, d, b: torch.linalg.cholesky(-torch.eye(3, device=d) if b else torch.eye(3, device=d))),
    ("grid_sampler nan", lambda s, d, b: F.grid_sample(s.view(1, 1, 8, 4), torch.zeros(1, 2, 2, 2, device=d))),
]
for name, fn in CASES:
    try:
        fn(mk("cpu"), "cpu", True); cpu = None
    except Exception as ex:  # noqa: BLE001
        cpu = ex
    s = mk(DEV)
    try:
        for _ in range(2):
            fn(s, DEV, False)
            (fn(s, DEV, False) * 1).cpu() if fn(s, DEV, False).is_floating_point() else None
    except Exception as ex:  # noqa: BLE001
        print(f"  warm {name}: {type(ex).__name__} {str(ex)[:80]}")
    torch.neuron.synchronize()
    slow()
    where = "call"
    got = None
    try:
        r = fn(s, DEV, True)
        dep = r * 1 if r.is_floating_point() else r + 0
        where = "sync"
        torch.neuron.synchronize()
        where = "read"
        r.cpu()
    except Exception as ex:  # noqa: BLE001
        got = ex
    if cpu is None:
        check(got is None, f"{name}: CPU raises nothing; neuron {type(got).__name__} at {where}")
        drain(); continue
    same = type(got) is type(cpu) and str(cpu).split("\n")[0][:40] in str(got)
    check(same, f"{name}: neuron {type(got).__name__} at {where} vs CPU {type(cpu).__name__}" + ("" if same else f" | neuron: {str(got)[:100]!r} | cpu: {str(cpu)[:100]!r}"))
    if where == "sync":
        for nm, t in (("result", r), ("dependent", dep)):
            try:
                v = t.cpu()
                check(False, f"{name}: {nm} readable after the failure: {v.flatten()[:4].tolist()}")
            except Exception as ex:  # noqa: BLE001
                check(type(ex) is type(cpu), f"{name}: {nm} poisoned ({type(ex).__name__})")
    drain()
done()
