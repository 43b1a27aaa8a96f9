"""Poison across devices (copy of a failed result to neuron:1), non_blocking H2D from pinned memory over a poisoned
tensor, record_stream on a failed result, inference_mode results."""
import torch
from _pc import DEV, check, done, drain, failing

E = IndexError
print("device count", torch.neuron.device_count())
if torch.neuron.device_count() > 1:
    for seen_first in (False, True):
        bad = failing()
        if seen_first:
            drain()
        try:
            other = bad.to("neuron:1")
            try:
                torch.neuron.synchronize("neuron:1")
            except E:
                pass
            drain()
            try:
                v = other.cpu()
                check(False, f"copy to neuron:1 of a failed result readable (seen first={seen_first}): {v.tolist()}")
            except E:
                check(True, f"copy to neuron:1 poisoned (seen first={seen_first})")
        except E:
            check(True, f"copy to neuron:1 raised at the call (seen first={seen_first})")
        drain()
# pinned non_blocking H2D over a whole poisoned tensor clears it
bad = failing()
drain()
src = torch.arange(8.0).view(2, 4).pin_memory()
bad.copy_(src, non_blocking=True)
try:
    check(torch.equal(bad.cpu(), src), "non_blocking pinned H2D over a poisoned tensor clears it")
except E:
    check(False, "non_blocking pinned H2D over a whole poisoned tensor: still poisoned")
# record_stream on a failed result, used on a side stream, freed
side = torch.neuron.Stream()
with torch.neuron.stream(side):
    (torch.ones(2, 4, device=DEV) * 2).cpu()  # the signature known on the side stream
bad = failing()
side.wait_stream(torch.neuron.current_stream())
with torch.neuron.stream(side):
    try:
        use = bad * 2
    except E:
        use = None
        print("  (side-stream read raised at the call)")
bad.record_stream(side)
del bad
fresh = torch.ones(2, 4, device=DEV)  # may reuse the block
drain()
try:
    check(torch.equal(fresh.cpu(), torch.ones(2, 4)), "a fresh tensor after the failed one was freed is clean")
except E:
    check(False, "a fresh tensor inherited the freed failed tensor's poison")
if use is not None:
    try:
        use.cpu()
        check(False, "side-stream reader of the failed result readable")
    except E:
        check(True, "side-stream reader poisoned")
# inference mode
with torch.inference_mode():
    bad = failing()
    r = bad + 1
drain()
try:
    r.cpu()
    check(False, "inference-mode dependent readable")
except E:
    check(True, "inference-mode dependent poisoned")
done()
