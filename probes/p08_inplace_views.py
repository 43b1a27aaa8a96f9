"""In-place ops and writes on views of poisoned storage; whole-storage overwrites clear; partial ones do not."""
import torch
from _pc import DEV, check, done, drain, failing, no_raise, raises, slow


def fresh():
    bad = failing()
    drain()
    return bad

E = IndexError
bad = fresh()
raises(lambda: bad[0].add_(1), E, what="add_ on a view of poisoned")
raises(lambda: bad.cpu(), E, what="still poisoned after a failed add_")
for name, f, want in [("zero_", lambda t: t.zero_(), torch.zeros(2, 4)), ("fill_", lambda t: t.fill_(3.0), torch.full((2, 4), 3.0)),
                      ("nn.init.zeros_", torch.nn.init.zeros_, torch.zeros(2, 4)), ("normal_", lambda t: t.normal_(), None)]:
    bad = fresh()
    try:
        f(bad)
        v = bad.cpu()
        check(want is None or torch.equal(v, want), f"{name} of the whole poisoned tensor clears it")
    except IndexError:
        check(False, f"{name} of the whole poisoned tensor (writes all, reads none) raises IndexError")
bad = fresh()
bad.view(-1).copy_(torch.arange(8.0))
no_raise(lambda: check(torch.equal(bad.cpu(), torch.arange(8.0).view(2, 4)), "copy_ via flat view clears"), "read after flat-view copy_")
bad = fresh()
bad.copy_(torch.ones(4))  # broadcast copy covering all
no_raise(lambda: check(torch.equal(bad.cpu(), torch.ones(2, 4)), "broadcast copy_ clears"), "read after broadcast copy_")
bad = fresh()
bad[:, :2].copy_(torch.ones(2, 2))
raises(lambda: bad.cpu(), E, what="copy_ into half leaves it poisoned")
# copy_ whose source is poisoned: dest becomes poisoned
bad = fresh()
dst = torch.zeros(2, 4, device=DEV)
try:
    dst.copy_(bad)
    raises(lambda: dst.cpu(), E, what="dst after copy_ from poisoned")
except IndexError:
    check(True, "copy_ from poisoned raises at the call")
# out= covering a poisoned tensor from a good computation clears it
bad = fresh()
torch.add(torch.ones(2, 4, device=DEV), 1, out=bad)
no_raise(lambda: check(torch.equal(bad.cpu(), torch.full((2, 4), 2.0)), "out= clears"), "read after out=")
# a larger storage: a view poisoned via out=, the rest of the storage
base = torch.zeros(4, 4, device=DEV)
src = torch.randn(8, 4, device=DEV)
torch.index_select(src, 0, torch.tensor([0, 1], device=DEV), out=base[:2])
torch.neuron.synchronize()
slow()
torch.index_select(src, 0, torch.tensor([0, 99], device=DEV), out=base[:2])
drain()
raises(lambda: base[:2].cpu(), E, what="out= view written by the failed kernel")
try:
    v = base[2:].cpu()
    check(torch.equal(v, torch.zeros(2, 4)), "rest of the storage is zeros (not written)")
except IndexError:
    check(True, "rest of the storage conservatively poisoned")
# detach / requires_grad views
bad = fresh()
raises(lambda: bad.detach().cpu(), E, what="detach() view")
raises(lambda: bad.as_strided((1,), (1,), 7).cpu(), E, what="as_strided view of the last element")
raises(lambda: bad.unsqueeze(0).expand(3, 2, 4).contiguous().cpu(), E, what="expand view")
raises(lambda: bad.real.cpu() if False else bad.view(torch.uint8).cpu(), E, what="uint8 view")
done()
