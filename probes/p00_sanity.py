import time

import torch

x = torch.randn(1024, 1024, device="neuron"); w = torch.randn(1024, 1024, device="neuron") / 32
torch.neuron.synchronize()
def slow(n=6):
    y = x
    for _ in range(n): y = torch.tanh(y @ w)
    return y
slow(1); torch.neuron.synchronize()
t = time.perf_counter(); slow(); t1 = time.perf_counter() - t; torch.neuron.synchronize(); t2 = time.perf_counter() - t
print("launch", t1, "total", t2)
src = torch.randn(8, 4, device="neuron")
torch.index_select(src, 0, torch.tensor([0, 1], device="neuron")) + 1
slow()
bad = torch.index_select(src, 0, torch.tensor([0, 99], device="neuron"))
print("launched")
try:
    torch.neuron.synchronize(); print("NO ERROR")
except Exception as e: print(type(e).__name__, str(e)[:300])
