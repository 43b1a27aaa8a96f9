"""Failures under autocast (bf16) and through nn.Module forward on the queued path; the error type and the
poisoning of results kept alive."""
import torch
import torch.nn.functional as F
from _pc import DEV, check, done, drain, slow

E = IndexError
emb = torch.nn.Embedding(8, 1024).to(DEV)
ln = torch.nn.LayerNorm(1024, bias=False).to(DEV)
good = torch.tensor([[0, 1, 2, 3]] * 64, device=DEV)
bad = torch.tensor([[0, 1, 2, 99]] * 64, device=DEV)
for _ in range(2):
    with torch.autocast("neuron", dtype=torch.bfloat16):
        h = emb(good)
        y = ln(h)
        z = F.linear(y, torch.ones(256, 1024, device=DEV))
    z.float().sum().backward()
torch.neuron.synchronize()
slow()
with torch.autocast("neuron", dtype=torch.bfloat16):
    h = emb(bad)
    y = ln(h)
    z = F.linear(y, torch.ones(256, 1024, device=DEV))
try:
    z.float().sum().backward()
except E:
    check(True, "backward raised at the call")
try:
    torch.neuron.synchronize()
except E:
    check(True, "sync raised the IndexError")
for nm, t in (("h", h), ("y", y), ("z", z), ("emb.weight.grad", emb.weight.grad), ("ln.weight.grad", ln.weight.grad)):
    try:
        v = t.cpu()
        check(nm.endswith("grad") and False, f"{nm} readable: {v.flatten()[:2].tolist()}")
    except E:
        check(True, f"{nm} poisoned")
drain()
done()
