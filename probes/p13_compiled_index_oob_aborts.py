"""A torch.compile(backend="neuron") function whose index_select gets an out-of-range index aborts the whole
process ("terminate called after throwing an instance of 'std::runtime_error' ... index out of bounds", status 134)
instead of raising. Expected: an exception (CPU eager: IndexError; CUDA: a device-side assert error raised at a
sync point), and the interpreter survives. (Plain CPU inductor aborts too: the Inductor C++ kernel's TORCH_CHECK
throws inside an OpenMP region; the neuron backend inherits it, also when queued on a stream worker.)"""
import sys

import torch

queued = len(sys.argv) > 1 and sys.argv[1] == "queued"


def f(x, idx):
    return torch.index_select(x, 0, idx) * 2 + 1


cf = torch.compile(f, backend="neuron")
src = torch.randn(8, 1024, device="neuron")
for _ in range(3):
    cf(src, torch.tensor([0, 1] * 128, device="neuron"))
torch.neuron.synchronize()
if queued:
    from _pc import slow
    slow()
try:
    r = cf(src, torch.tensor([0, 99] * 128, device="neuron"))
    r.cpu()
    print("BUG: no error")
except Exception as e:  # noqa: BLE001
    print("OK: raised", type(e).__name__, str(e)[:100])
