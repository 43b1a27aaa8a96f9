"""After a failure has been reported, copying the poisoned tensor to another device (`bad.to("neuron:1")`) raises at
the call, as it should, but leaves neuron:0's stream wedged: later work queued behind it never runs, so a
synchronize hangs (here: bounded by a 10 s watchdog) and the exit drain times out (status 1 after
TORCHNEURON_EXIT_TIMEOUT). Expected: the refused copy leaves nothing queued; the stream goes on."""
import os
import threading

import torch
from _pc import DEV, drain, failing

bad = failing()
drain()  # the IndexError raised once
try:
    bad.to("neuron:1")
    print("copy did not raise")
except IndexError:
    print("OK: the copy of a poisoned tensor raised at the call")
y = torch.ones(1024, 1024, device=DEV) * 2  # queued on neuron:0's default stream
result = []


def sync() -> None:
    try:
        torch.neuron.synchronize(0)
        result.append(float(y[0, 0].item()))
    except Exception as e:  # noqa: BLE001
        result.append(f"{type(e).__name__}: {str(e)[:120]}")


t = threading.Thread(target=sync, daemon=True)
t.start()
t.join(10)
print("OK: neuron:0 synchronize ->", result[0] if result else "") if result else print(
    "BUG: torch.neuron.synchronize(0) still waiting after 10 s")
os._exit(0 if result else 1)
