"""A failure inside backward (custom Function whose backward index_selects out of range), then Adam step: the error
surfaces at a sync point; grads and params written by skipped work are poisoned, never garbage; independent params
are updated right; memory does not leak across repeated failures."""
import torch
from _pc import DEV, check, done, drain, slow


class BadBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, idx):
        ctx.save_for_backward(idx)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        return torch.index_select(g, 0, idx), None


def step(dev, bad, opt, w1, w2, x):
    opt.zero_grad()
    idx = torch.arange(64, device=dev)
    if bad:
        idx = idx.clone(); idx[5] = 999
    y = BadBack.apply(x @ w1, idx)
    loss = y.pow(2).mean() + (x @ w2).pow(2).mean()
    loss.backward()
    opt.step()
    return loss


torch.manual_seed(0)
x = torch.randn(64, 1024)
W1, W2 = torch.randn(1024, 1024) / 32, torch.randn(1024, 1024) / 32
res = {}
for dev in ("cpu", DEV):
    w1, w2 = W1.clone().to(dev).requires_grad_(), W2.clone().to(dev).requires_grad_()
    xd = x.to(dev)
    opt = torch.optim.Adam([w1, w2], lr=0.01)
    step(dev, False, opt, w1, w2, xd)
    step(dev, False, opt, w1, w2, xd)
    if dev != "cpu":
        torch.neuron.synchronize()
        slow()
    try:
        step(dev, True, opt, w1, w2, xd)
        if dev != "cpu":
            torch.neuron.synchronize()
        err = None
    except Exception as ex:  # noqa: BLE001
        err = type(ex).__name__
    out = {"err": err}
    for n, p in (("w1", w1), ("w2", w2), ("w1.grad", w1.grad), ("w2.grad", w2.grad)):
        try:
            out[n] = p.detach().cpu().clone() if p is not None else None
        except Exception as ex:  # noqa: BLE001
            out[n] = type(ex).__name__
    res[dev] = out
c, n = res["cpu"], res[DEV]
print("cpu error:", c["err"], " neuron error:", n["err"])
check(n["err"] == c["err"], f"backward failure raised ({n['err']}, CPU {c['err']})")
for k in ("w1", "w2", "w1.grad", "w2.grad"):
    cv, nv = c[k], n[k]
    if k in ("w1", "w1.grad") and not isinstance(nv, str):
        check(False, f"{k}: written by skipped work (backward reading the failed index_select) yet readable")
    elif k == "w2":
        check(not isinstance(nv, str), "w2: independent of the failure, readable (updated by the step CPU never reached)")
    elif isinstance(nv, str):
        check(nv == c["err"], f"{k}: poisoned ({nv})")
    elif nv is None or cv is None:
        check(nv is None and cv is None, f"{k}: None on both ({type(nv)}, {type(cv)})")
    else:
        same = torch.allclose(nv, cv, atol=1e-5)
        check(same, f"{k}: readable and equal to the CPU's after the failed step (max diff {(nv - cv).abs().max().item():.3g})")
# memory: repeated failures do not leak
torch.neuron.synchronize()
m0 = torch.neuron.memory_allocated()
src = torch.randn(8, 1024, device=DEV)
for i in range(30):
    slow(1)
    try:
        b = torch.index_select(src, 0, torch.tensor([0, 99] * 64, device=DEV)) * 2
    except IndexError:
        b = None
    drain()
    del b
torch.neuron.synchronize()
m1 = torch.neuron.memory_allocated()
check(m1 - m0 < 4 << 20, f"memory after 30 failures: {m0} -> {m1}")
done()
