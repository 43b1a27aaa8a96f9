"""A failed kernel's result freed on the host while it is still queued (a temporary: `(emb(idx) ...)`, or `del`)
drops the poison for kernels queued after it that read it: they run on the uncomputed memory and their results are
readable values once the IndexError has been raised. Expected: `r` stays poisoned (IndexError on every read), as
it does when `e` is kept alive."""
import torch
from _pc import DEV, drain, slow

src = torch.randn(8, 1024, device=DEV)
good = torch.tensor([0, 1, 2, 3] * 64, device=DEV)
badi = torch.tensor([0, 1, 2, 99] * 64, device=DEV)
(torch.index_select(src, 0, good) * 2).cpu()  # signatures known: both queue below
torch.neuron.synchronize()
for keep in (True, False):
    slow()
    e = torch.index_select(src, 0, badi)  # fails on the worker
    r = e * 2  # skipped: reads what the failed kernel did not write
    if not keep:
        del e  # freed while its kernel is still queued
    try:
        r.cpu()
    except IndexError:
        pass  # the failure, raised once
    try:
        print(f"BUG (keep e={keep}): r reads as values", r.cpu()[3, :3].tolist())
    except IndexError:
        print(f"OK (keep e={keep}): r stays poisoned")
    drain()
