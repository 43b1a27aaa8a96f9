"""`.item()` does not raise a pending kernel error of the current stream, while `.cpu()` does (docs/device.md lists
`.item()` among the sync points; CUDA's `.item()` raises the sticky error). Expected: IndexError from z.item()."""
import torch
from _pc import DEV, drain, failing

o = torch.ones(1024, 1024, device=DEV)
o.sum().item()
for read in ("cpu", "item"):
    torch.neuron.synchronize()
    bad = failing()  # queued index_select that fails
    z = o.sum()  # independent, queued behind it
    try:
        v = z.item() if read == "item" else z.cpu()
        print(f"BUG: z.{read}() returned {v}; the pending IndexError was not raised")
    except IndexError:
        print(f"OK: z.{read}() raised the pending IndexError")
    drain()
