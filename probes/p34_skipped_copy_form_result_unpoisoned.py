"""Fixed (queued_launch.cpp: an empty out= argument sized at the launch is in the kernel's writes);
test_a_skipped_kernels_result_sized_at_its_launch_is_poisoned. Found by the long fuzz run (seed 1300539, queue-everything). In queue-everything mode, `t5.abs()` queued
behind a failing in-place `index_add_` into int64 `t5` is skipped, but its result is not poisoned: after the
IndexError has been raised once, `t14.cpu()` returns uninitialised memory. `t5 * 1`, `-t5` and `t5.float()` in the
same place are poisoned. Expected: IndexError ("never computed") from t14.cpu()."""
import torch
import torchneuron

torchneuron._C._set_queue_everything(True)
dev = "neuron"
t5 = torch.tensor([131486, 90785, 135318, 188219, 241119, 58098], device=dev)
t4 = torch.arange(16, device=dev)
w = t5.clone()
w.index_add_(0, torch.tensor([0, 1, 2, 3, 4, 5], device=dev), t4[:1].expand(6))
w.abs()  # signatures known: both queue below
torch.neuron.synchronize()
a = torch.full((512, 512), 1e-3, device=dev)
for _ in range(4):
    a = a @ a
t5.index_add_(0, torch.tensor([7] * 6, device=dev), t4[:1].expand(6))  # fails on the worker
t14 = t5.abs()  # reads t5: skipped
try:
    torch.neuron.current_stream().synchronize()
except IndexError:
    pass
try:
    print("BUG: t14 reads as values", t14.cpu().tolist())
except IndexError:
    print("OK: t14 is poisoned")
