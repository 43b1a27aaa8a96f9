"""Explicit kernels (SDPA, conv2d) and foreach/Adam on poisoned inputs that Python keeps alive: results poisoned;
Adam's params and state poisoned, not updated from uncomputed grads."""
import torch
import torch.nn.functional as F
from _pc import DEV, check, done, drain, slow

E = IndexError
src = torch.randn(64, 4096, device=DEV)
good = torch.arange(64, device=DEV)
badi = good.clone()
badi[7] = 999


def poisoned():
    slow()
    return torch.index_select(src, 0, badi)


CASES = {
    "sdpa (contiguous temporaries: the freed-result bug, p05)": lambda e: F.scaled_dot_product_attention(e.view(2, 4, 32, 1024)[..., :64].contiguous(),
                                                     e.view(2, 4, 32, 1024)[..., :64].contiguous(),
                                                     e.view(2, 4, 32, 1024)[..., :64].contiguous()),
    "sdpa direct": lambda e: F.scaled_dot_product_attention(e.view(2, 4, 32, 1024), e.view(2, 4, 32, 1024),
                                                            e.view(2, 4, 32, 1024)),
    "conv2d": lambda e: F.conv2d(e.view(4, 16, 64, 64), torch.ones(8, 16, 3, 3, device=DEV)),
    "layer_norm": lambda e: F.layer_norm(e, (4096,)),
    "softmax": lambda e: e.softmax(-1),
    "matmul": lambda e: e @ torch.ones(4096, 8, device=DEV),
}
for name, f in CASES.items():
    for _ in range(2):
        f(torch.index_select(src, 0, good)).cpu()
    torch.neuron.synchronize()
    e = poisoned()
    try:
        r = f(e)
    except E:
        check(True, f"{name}: raised at the call")
        drain()
        continue
    try:
        torch.neuron.synchronize()
        check(False, f"{name}: no error at sync")
    except E:
        pass
    try:
        v = r.cpu()
        check(False, f"{name}: result readable: {v.flatten()[:3].tolist()}")
    except E:
        check(True, f"{name}: result poisoned")
    drain()

# Adam with a poisoned grad (kept alive): params must not be updated from it
w = torch.nn.Parameter(torch.randn(64, 4096, device=DEV))
w2 = torch.nn.Parameter(torch.randn(64, 4096, device=DEV))
opt = torch.optim.Adam([w, w2], lr=0.1)
for _ in range(2):
    w.grad = torch.ones_like(w)
    w2.grad = torch.ones_like(w2)
    opt.step()
torch.neuron.synchronize()
w_before, w2_before = w.detach().cpu().clone(), w2.detach().cpu().clone()
g = poisoned()
w.grad = g
w2.grad = torch.ones_like(w2)
opt.step()
try:
    torch.neuron.synchronize()
except E:
    pass
for nm, p, b in (("w", w, w_before),):
    try:
        v = p.detach().cpu()
        check(torch.equal(v, b), f"Adam {nm} from a poisoned grad: readable, {'unchanged' if torch.equal(v, b) else 'UPDATED'}")
    except E:
        check(True, f"Adam {nm}: poisoned")
    for k, t in opt.state[p].items():
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            try:
                t.cpu()
                check(False, f"Adam state {k} readable after a poisoned grad")
            except E:
                check(True, f"Adam state {k} poisoned")
try:
    v2 = w2.detach().cpu()
    check(not torch.equal(v2, w2_before), "w2 (good grad) updated by the same foreach step")
except E:
    print("NOTE: w2 (good grad) poisoned too: the foreach kernel over [w, w2] is skipped whole")
done()
