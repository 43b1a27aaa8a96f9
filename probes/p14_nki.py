"""NKI kernels (torchneuron.nki) on poisoned inputs, on a side stream, and host-checkable rule errors while queued."""
import torch
from _pc import DEV, check, done, drain, no_raise, raises, slow

import torchneuron.nki as nki
from torchneuron.nki import isa as nisa
from torchneuron.nki import language as nl

E = IndexError


@nki.jit
def add_kernel(a, b):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    for r in nl.affine_range(a.shape[0] // 128):
        rows = nl.ds(r * 128, 128)
        x = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        y = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=a[rows, :])
        nisa.dma_copy(dst=y, src=b[rows, :])
        z = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=z, data1=x, data2=y, op=nl.add)
        nisa.dma_copy(dst=out[rows, :], src=z)
    return out


src = torch.randn(8, 128, device=DEV)
a = torch.randn(256, 128, device=DEV)
good = torch.tensor([0, 1] * 128, device=DEV)
bad_i = torch.tensor([0, 99] * 128, device=DEV)
for _ in range(2):
    add_kernel(torch.index_select(src, 0, good), a)
torch.neuron.synchronize()
ref = (torch.index_select(src, 0, good) + a).cpu()
check(torch.allclose(add_kernel(torch.index_select(src, 0, good), a).cpu(), ref), "nki good values")
# poisoned input still queued
slow()
e = torch.index_select(src, 0, bad_i)
try:
    out = add_kernel(e, a)
    raises(lambda: out.cpu(), E, what="NKI kernel on a (queued) failed input: result raises")
    raises(lambda: out.cpu(), E, what="NKI result stays poisoned")
except E:
    check(True, "NKI on failed input raised at the call")
drain()
# same with the failed input freed (temporary)
slow()
try:
    out = add_kernel(torch.index_select(src, 0, bad_i), a)
    try:
        out.cpu()
    except E:
        pass
    raises(lambda: out.cpu(), E, what="NKI result of a freed failed temporary stays poisoned")
except E:
    check(True, "raised at call")
drain()
# side stream: failing input on side, NKI on default after wait_stream
side = torch.neuron.Stream()
with torch.neuron.stream(side):
    slow()
    e2 = torch.index_select(src, 0, bad_i)
torch.neuron.current_stream().wait_stream(side)
try:
    out2 = add_kernel(e2, a)
    raises(lambda: torch.neuron.current_stream().synchronize(), E, what="side-stream failure surfaces on the NKI's stream")
    raises(lambda: out2.cpu(), E, what="NKI result poisoned")
except E:
    check(True, "raised at call")
drain()
# host-checkable: shape rule broken while work queued (256 rows but 100-row second arg)
slow()
y = torch.ones(1024, 1024, device=DEV) * 2
try:
    add_kernel(a, torch.randn(100, 128, device=DEV))
    check(False, "NKI with mismatched shapes did not raise at the call")
except Exception as ex:  # noqa: BLE001
    check(True, f"NKI mismatched shapes raised at the call: {type(ex).__name__}: {str(ex)[:100]}")
no_raise(lambda: check(torch.equal(y.cpu(), torch.full((1024, 1024), 2.0)), "queued work fine"), "read after")
done()
