"""torch.compile(backend="neuron") kernels: failure inside on a side stream, poisoned inputs, host checks.
Run with OMP_NUM_THREADS=1: with more threads the out-of-range index aborts the process (p13)."""
import torch
from _pc import DEV, check, done, drain, failing, no_raise, raises, slow

E = IndexError

def f(x, idx):
    return torch.index_select(x, 0, idx) * 2 + 1

cf = torch.compile(f, backend="neuron")
cfi = torch.compile(f, backend="inductor")
src = torch.randn(8, 1024)
good, badi = torch.tensor([0, 1] * 128), torch.tensor([0, 99] * 128)
# CPU reference behaviour of compiled and eager
cpu_exc = "abort"  # CPU inductor: std::terminate inside its OpenMP region (PyTorch's own behaviour)
try:
    f(src, badi); eager_exc = None
except Exception as ex:  # noqa: BLE001
    eager_exc = type(ex).__name__
print("CPU inductor raises", cpu_exc, "; CPU eager raises", eager_exc)
sd, gd, bd = src.to(DEV), good.to(DEV), badi.to(DEV)
for _ in range(3):
    cf(sd, gd)
torch.neuron.synchronize()
check(torch.allclose(cf(sd, gd).cpu(), f(src, good)), "compiled good values")
side = torch.neuron.Stream()
with torch.neuron.stream(side):
    slow()
    try:
        r = cf(sd, bd)
        launched = True
    except Exception as ex:  # noqa: BLE001
        launched = False
        print("compiled call raised at the call:", type(ex).__name__)
torch.neuron.current_stream().wait_stream(side)
if launched:
    ex = raises(lambda: r.sum().cpu(), Exception, what="compiled failure on side stream surfaces on the waiting stream")
    if ex is not None:
        check(type(ex).__name__ in (cpu_exc, eager_exc), f"exception type {type(ex).__name__} matches CPU compiled ({cpu_exc}) or eager ({eager_exc})")
    raises(lambda: r.cpu(), Exception, what="compiled result poisoned afterwards")
drain()
# poisoned input to a compiled fn
def g(x):
    return (x * 3).sum(0)
cg = torch.compile(g, backend="neuron")
for _ in range(3):
    cg(torch.randn(2, 4, device=DEV))
torch.neuron.synchronize()
bad = failing()
try:
    out = cg(bad)
    raises(lambda: out.cpu(), E, what="compiled fn on a poisoned (still queued) input: result raises")
except E:
    check(True, "compiled fn on poisoned input raised at call")
drain()
raises(lambda: cg(bad).cpu(), E, what="compiled fn on a poisoned input (already reported)")
# host-checkable: shape mismatch inside compiled fn while work queued
def h(a, b):
    return a @ b
ch = torch.compile(h, backend="neuron", dynamic=False)
a, b = torch.randn(64, 32, device=DEV), torch.randn(32, 16, device=DEV)
ch(a, b); ch(a, b)
torch.neuron.synchronize()
slow()
y = torch.ones(1024, 1024, device=DEV) * 2
try:
    ch(a, torch.randn(31, 16, device=DEV))
    check(False, "compiled shape mismatch did not raise at the call")
except Exception as ex:  # noqa: BLE001
    check(isinstance(ex, RuntimeError), f"compiled shape mismatch raised {type(ex).__name__} at the call")
no_raise(lambda: check(torch.equal(y.cpu(), torch.full((1024, 1024), 2.0)), "queued work unaffected"), "read after")
# in-place mutation inside compiled fn reading poisoned
def m(x, y):
    x.add_(y)
    return x * 2
cm = torch.compile(m, backend="neuron")
for _ in range(3):
    cm(torch.randn(2, 4, device=DEV), torch.randn(2, 4, device=DEV))
torch.neuron.synchronize()
x = torch.zeros(2, 4, device=DEV)
bad = failing()
try:
    r = cm(x, bad)
    drain()
    raises(lambda: x.cpu(), E, what="compiled in-place add_ of a poisoned input leaves x poisoned")
    raises(lambda: r.cpu(), E, what="its result poisoned")
except E:
    check(True, "compiled in-place raised at call")
drain()
done()
