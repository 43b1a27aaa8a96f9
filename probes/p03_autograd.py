"""Failures in autograd forward/backward on the queued path, and an optimizer step afterwards."""
import torch
import torch.nn.functional as F
from _pc import DEV, check, done, drain, failing, raises, no_raise, slow


def run(dev, bad_idx, busy):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(8, 1024).to(dev)
    lin = torch.nn.Linear(1024, 1024).to(dev)
    opt = torch.optim.Adam(list(emb.parameters()) + list(lin.parameters()), lr=0.1)
    good = torch.tensor([[0, 1, 2, 3]] * 64, device=dev)
    # warm signatures
    for _ in range(2):
        opt.zero_grad(); lin(emb(good)).pow(2).mean().backward(); opt.step()
    if dev != "cpu":
        torch.neuron.synchronize()
    w_before = emb.weight.detach().cpu().clone()
    if busy:
        slow()
    idx = torch.tensor([[0, 1, 2, bad_idx]] * 64, device=dev)
    events = []
    try:
        opt.zero_grad()
        out = lin(emb(idx))
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        events.append(("step-done", None))
        loss.item()
    except Exception as e:  # noqa: BLE001
        events.append(("raised", type(e).__name__))
    if dev != "cpu":
        drain()
    # params must be either unchanged (CPU) or raise when read; never garbage
    res = {}
    for name, p in [("emb.weight", emb.weight), ("lin.weight", lin.weight)]:
        try:
            res[name] = p.detach().cpu().clone()
        except Exception as e:  # noqa: BLE001
            res[name] = type(e).__name__
    # recover: reload state, a good step
    return events, res, w_before, emb, lin, opt, good


ev_c, res_c, wb_c, *_ = run("cpu", 99, False)
ev_n, res_n, wb_n, emb, lin, opt, good = run(DEV, 99, True)
print("cpu:", ev_c, "neuron:", ev_n)
check(ev_n[-1] == ("raised", "IndexError"), f"failed embedding forward then backward raises IndexError ({ev_n})")
for k in res_n:
    v = res_n[k]
    if isinstance(v, str):
        check(v == "IndexError", f"{k} after failed step: poisoned read raises {v}")
    else:
        ok = torch.isfinite(v).all().item() and v.abs().max().item() < 1e6
        check(ok, f"{k} after failed step finite (max {v.abs().max().item():.3g})")
        if k == "emb.weight":
            check(torch.equal(v, wb_n) or ev_n[0][0] == "step-done", f"{k} unchanged when no step ran")
done()
