"""A failure on stream a reaches b through b.wait_event(ev), and c through c.wait_stream(b). If b then runs an op
whose signature is new (its first call runs on the host after b's queued work: a runtime-only sync point), c no
longer receives the failure: c.synchronize() raises nothing (the failure is raised later by a device-wide sync).
Expected: c.synchronize() raises the IndexError, as it does when b's op signature is already known."""
import torch
from _pc import DEV, drain, failing

a, b, c = torch.neuron.Stream(), torch.neuron.Stream(), torch.neuron.Stream()
for n, known in ((1000, False), (1000, True), (1001, False)):
    with torch.neuron.stream(a):
        bad = failing()
        ev = torch.neuron.Event()
        ev.record()
    b.wait_event(ev)
    with torch.neuron.stream(b):
        y = torch.ones(n, 1024, device=DEV) * 2  # signature new the first time for each n
    c.wait_stream(b)
    try:
        c.synchronize()
        print(f"BUG (b's op signature known={known}): c.synchronize() raised nothing")
    except IndexError:
        print(f"OK (b's op signature known={known}): c.synchronize() raised the IndexError")
    drain()
