"""Training step whose embedding lookup fails on the worker (index 99 of 8): backward and SGD step are queued
behind it, and the parameters come out updated with gradients computed from uncomputed memory, readable, no
poison. CPU: the forward raises and nothing is updated. Expected on neuron: the IndexError surfaces, and the
grads/params written by the skipped backward and step are poisoned (or unchanged), never garbage-updated."""
import torch
from _pc import DEV, drain, slow

torch.manual_seed(0)
emb, lin = torch.nn.Embedding(8, 1024).to(DEV), torch.nn.Linear(1024, 1024).to(DEV)
params = list(emb.parameters()) + list(lin.parameters())
opt = torch.optim.SGD(params, lr=0.1)
good = torch.tensor([[0, 1, 2, 3]] * 64, device=DEV)
for _ in range(3):  # signatures known: the failing step queues
    opt.zero_grad(); lin(emb(good)).pow(2).mean().backward(); opt.step()
torch.neuron.synchronize()
before = [p.detach().cpu().clone() for p in params]
slow()
opt.zero_grad()
lin(emb(torch.tensor([[0, 1, 2, 99]] * 64, device=DEV))).pow(2).mean().backward()
opt.step()
raised = False
try:
    torch.neuron.synchronize()
except IndexError:
    raised = True
print("IndexError raised at synchronize:", raised)
for (name, p), b in zip([("emb.weight", emb.weight), ("lin.weight", lin.weight), ("lin.bias", lin.bias)], before):
    try:
        v = p.detach().cpu()
    except IndexError:
        print(f"OK: {name} poisoned")
        continue
    print(("OK" if torch.equal(v, b) else "BUG") + f": {name} readable, changed by {(v - b).abs().max().item():.3g}")
drain()
