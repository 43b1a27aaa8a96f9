"""The launch queue has no depth bound: 0.1 s of host launches (512x512 matmul + tanh) queue ~20k kernels, i.e.
~30 s of device work; a later sync point, first-call op or exit drain waits for all of it (a daemon thread launching
in a loop makes another thread's first call of a new op signature wait for millions of kernels). CUDA blocks a launch
once ~1024 are pending. Expected: a bounded queue (launch blocks when full), so the drain here is well under 1 s."""
import time

import torch

x = torch.ones(512, 512, device="neuron"); (x @ x).tanh(); torch.neuron.synchronize()
t = time.perf_counter(); n = 0
while time.perf_counter() - t < 0.1:
    x = (x @ x).tanh(); n += 1
t1 = time.perf_counter(); torch.neuron.synchronize(); print("launched", n, "iterations in 0.1 s; drain took", round(time.perf_counter() - t1, 1), "s")
