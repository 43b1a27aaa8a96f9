"""Two independent failures on two streams (index_select out of range on a, gather out of range on b). One
torch.neuron.synchronize() raises a's; b's failure is never raised by any later sync point nor printed at exit (the
process exits 0), so the user never learns that stream b's kernel failed. (docs/device.md: synchronize "reports
every stream's (the first is raised)"; but a stream "keeps every failure the user has not seen ... the next sync
point [raises] the one after it".) Expected: the next sync point raises b's RuntimeError (or exit prints it)."""
import torch
from _pc import DEV, failing, slow

a, b = torch.neuron.Stream(), torch.neuron.Stream()
src = torch.randn(8, 4, device=DEV)
with torch.neuron.stream(b):
    torch.index_add(src, 0, torch.tensor([1], device=DEV), torch.ones(1, 4, device=DEV)) + 1  # signature known
    torch.neuron.synchronize()
with torch.neuron.stream(a):
    ra = failing()
with torch.neuron.stream(b):
    slow()
    rb = torch.index_add(src, 0, torch.tensor([99], device=DEV), torch.ones(1, 4, device=DEV))  # RuntimeError on CPU
seen = []
for _ in range(3):
    try:
        torch.neuron.synchronize()
        seen.append(None)
    except Exception as e:  # noqa: BLE001
        seen.append(f"{type(e).__name__}: {str(e)[:50]}")
print("successive synchronize():", seen)
try:
    rb.cpu()
except Exception as e:  # noqa: BLE001
    print("reading rb raises:", type(e).__name__, str(e)[:60])
print("BUG: b's failure was never raised by a sync point" if sum(s is not None for s in seen) < 2 else "OK")
