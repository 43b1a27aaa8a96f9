"""Eager fusion: warm a pointwise loop (fused after 3 sightings), then inject failures: a poisoned input to the group,
integer division/remainder/fmod by zero in the middle of the group; compare with the CPU."""
import torch
from _pc import DEV, check, done, drain, no_raise, raises, slow

import torchneuron
from torchneuron.compiler import eager_fusion as ef
from torchneuron.runtime import tracking

N = 1 << 18


def body(x, y, d, op):
    a = x * 3
    b = a + y
    c = op(b, d)
    e = c + 7
    return a, b, c, e


OPS = {
    "floor_divide": lambda b, d: b // d,
    "remainder": lambda b, d: b % d,
    "fmod": lambda b, d: torch.fmod(b, d),
    "div_trunc": lambda b, d: torch.div(b, d, rounding_mode="trunc"),
    "div_floor": lambda b, d: torch.div(b, d, rounding_mode="floor"),
}
for name, op in OPS.items():
    x = torch.randint(-100, 100, (N,), dtype=torch.int32)
    y = torch.randint(-100, 100, (N,), dtype=torch.int32)
    d = torch.randint(1, 9, (N,), dtype=torch.int32)
    xd, yd, dd = x.to(DEV), y.to(DEV), d.to(DEV)
    for _ in range(12):
        slow(1)
        body(xd, yd, dd, op)
        ef.wait_compiles()
    torch.neuron.synchronize()
    print(name, "fusion counts after warm-up", torchneuron._C._fusion_counts())
    counts_before = dict(tracking.get_fusion_counts()) if hasattr(tracking, "get_fusion_counts") else {}
    d0 = d.clone(); d0[5] = 0
    try:
        body(x, y, d0, op); cpu_exc = None
    except Exception as ex:  # noqa: BLE001
        cpu_exc = type(ex).__name__
    dd0 = d0.to(DEV)
    torch.neuron.synchronize()
    slow()
    xk = xd.clone()  # an in-place op before the group
    xk.add_(1)
    try:
        outs = body(xk, yd, dd0, op)
        launched = True
    except Exception as ex:  # noqa: BLE001
        launched, outs = False, None
        check(type(ex).__name__ == cpu_exc, f"{name}: raised at call {type(ex).__name__} (CPU {cpu_exc})")
    if launched:
        try:
            torch.neuron.synchronize(); got = None
        except Exception as ex:  # noqa: BLE001
            got = type(ex).__name__
        check(got == cpu_exc, f"{name} by zero in a warmed fused group: sync raised {got} (CPU {cpu_exc})")
        # a, b computed before the failure: readable and right, or poisoned; c, e poisoned if CPU raised
        ref = body(x + 1, y, d, op)  # without zero for a and b
        for nm, t, r in zip("abce", outs, ref):
            try:
                v = t.cpu()
                if nm in "ab":
                    check(torch.equal(v, r), f"{name}: {nm} (before the failing op) equals CPU")
                elif cpu_exc is None:
                    rr = body(x + 1, y, d0, op)["abce".index(nm)]
                    check(torch.equal(v, rr), f"{name}: {nm} equals CPU (no CPU error)")
                else:
                    check(False, f"{name}: {nm} (after the failing op) readable: {v[:3].tolist()}")
            except Exception as ex:  # noqa: BLE001
                check(nm in "ce" and cpu_exc is not None, f"{name}: {nm} read raised {type(ex).__name__}")
    no_raise(lambda: check(torch.equal(xk.cpu(), x + 1), f"{name}: in-place before the group applied once"), f"{name}: xk read")
    drain()

# poisoned input into a warmed float group
x = torch.randn(N); xd = x.to(DEV)
src = torch.randn(8, N // 8, device=DEV)
def g(t):
    return ((t * 2 + 1).sin() * 3, (xd * 5 + 2))
for _ in range(12):
    slow(1)
    g(xd)
    ef.wait_compiles()
torch.neuron.synchronize()
print("fusion counts after warm-up:", torchneuron._C._fusion_counts())
(torch.index_select(src, 0, torch.arange(8, device=DEV)).reshape(-1) + 1).cpu()
torch.neuron.synchronize()
slow()
e = torch.index_select(src, 0, torch.tensor([0, 1, 2, 3, 4, 5, 6, 99], device=DEV)).reshape(-1)
p, q = g(e)
torch.neuron.current_stream().synchronize() if False else None
raises(lambda: torch.neuron.synchronize(), IndexError, what="poisoned input into a warmed fused group: sync raises")
raises(lambda: p.cpu(), IndexError, what="group output from poisoned input stays poisoned")
no_raise(lambda: check(torch.allclose(q.cpu(), x * 5 + 2), "independent output of the same run is right"), "independent output read")
print("fusion counts at the end:", torchneuron._C._fusion_counts())
done()
