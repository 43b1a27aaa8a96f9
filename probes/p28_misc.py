"""Odds and ends: CPU destination of a failed copy untouched; query() after a failure; a host-check error while a
failure is pending leaves it pending; wait_stream on a stream whose failure was already seen; partial-view reads."""
import torch
from _pc import DEV, check, done, drain, failing, no_raise, raises, slow

E = IndexError
bad = failing()
drain()
dst = torch.full((2, 4), 5.0)
raises(lambda: dst.copy_(bad), E, what="cpu_tensor.copy_(poisoned)")
check(torch.equal(dst, torch.full((2, 4), 5.0)), f"CPU destination untouched: {dst.tolist()}")
pin = torch.full((2, 4), 5.0).pin_memory()
raises(lambda: pin.copy_(bad, non_blocking=True) and torch.neuron.synchronize(), E, what="pinned.copy_(poisoned, non_blocking) raises at the call or sync")
check(torch.equal(pin, torch.full((2, 4), 5.0)), f"pinned destination untouched: {pin.tolist()}")
# query after failure
bad = failing()
s = torch.neuron.current_stream()
import time

t = time.time()
while not s.query() and time.time() - t < 10:
    time.sleep(0.01)
check(s.query(), "query() becomes True after the failed kernel (no raise, no hang)")
raises(lambda: torch.neuron.synchronize(), E, what="the failure still raised at the next sync after query()")
# host-check error while a failure is pending
bad = failing()
raises(lambda: torch.ones(3, device=DEV) + torch.ones(4, device=DEV), RuntimeError, what="own broadcast error first")
raises(lambda: torch.neuron.synchronize(), E, what="pending failure still raised afterwards")
# wait_stream on a producer whose failure was seen
side = torch.neuron.Stream()
with torch.neuron.stream(side):
    bad = failing()
raises(lambda: side.synchronize(), E, what="side raises its failure")
torch.neuron.current_stream().wait_stream(side)
no_raise(lambda: torch.neuron.current_stream().synchronize(), "waiting stream quiet after the failure was seen")
no_raise(lambda: torch.neuron.synchronize(), "device quiet")
# the poisoned row of a big tensor vs its good rows: any read of the storage raises (conservative), never values
src = torch.randn(8, 256, device=DEV)
torch.index_select(src, 0, torch.tensor([0, 1, 2, 3], device=DEV)) + 1
slow()
bad = torch.index_select(src, 0, torch.tensor([0, 1, 2, 99], device=DEV))
drain()
raises(lambda: bad[0].cpu(), E, what="row 0 of a failed result")
raises(lambda: bad[3].cpu(), E, what="row 3 of a failed result")
# chained views kept, base freed
bad = failing()
v = bad[1:]
del bad
drain()
raises(lambda: v.cpu(), E, what="a view of the failed result, base freed")
done()
