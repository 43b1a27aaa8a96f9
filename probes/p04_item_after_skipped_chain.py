"""`.item()` of a scalar computed from a skipped kernel's result (failed index_select -> e + 1 -> sum) returns an
uncomputed value and raises nothing, where `.cpu()` of the same scalar raises the IndexError. Expected (CPU: the
index_select raises; neuron's contract): `.item()` is a sync point, raises the pending IndexError, and the scalar
then stays poisoned."""
import torch
from _pc import DEV, drain, slow

src = torch.randn(8, 1024, device=DEV)
good = torch.tensor([0, 1, 2, 3] * 64, device=DEV)
for read in ("cpu", "item", "float", "tolist"):
    (torch.index_select(src, 0, good) + 1).sum().cpu()  # signatures known: everything below queues
    torch.neuron.synchronize()
    slow()
    e = torch.index_select(src, 0, torch.tensor([0, 1, 2, 99] * 64, device=DEV))  # fails on the worker
    s = (e + 1).sum()
    try:
        v = {"cpu": lambda: s.cpu(), "item": s.item, "float": lambda: float(s), "tolist": s.tolist}[read]()
        print(f"BUG: s.{read}() returned {v} without an error")
    except IndexError:
        print(f"OK: s.{read}() raised IndexError")
    drain()
