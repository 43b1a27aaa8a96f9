"""DataLoader: pin_memory with a worker exception (fork and spawn), after the parent queued work and has a pending
kernel error; batches moved to the device with non_blocking; nothing hangs; the parent's error is raised once."""
import torch
from _pc import DEV, check, done, drain, failing, slow
from torch.utils.data import DataLoader, Dataset


class DS(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 9:
            raise ValueError("bad sample 9")
        return self.base[i] * 1


if __name__ == "__main__":
    base = torch.zeros(16, 1024)
    hbase = base.to(DEV)
    hbase.add_(1)
    for ctx in ("fork", "spawn"):
        slow()
        base.copy_(hbase, non_blocking=False)  # written by the device before the loader starts
        bad = failing()  # pending in the parent
        dl = DataLoader(DS(base), batch_size=4, num_workers=2, pin_memory=True, multiprocessing_context=ctx)
        got, err = [], None
        try:
            for b in dl:
                got.append(b.to(DEV, non_blocking=True) * 2)
        except ValueError as ex:
            err = str(ex)
        except Exception as ex:  # noqa: BLE001
            err = f"{type(ex).__name__}: {ex}"
        check(err is not None and "bad sample 9" in err, f"{ctx}: worker's ValueError propagates ({str(err)[:100]})")
        vals = []
        try:
            vals = [g.cpu() for g in got]
            pend = None
        except Exception as ex:  # noqa: BLE001
            pend = type(ex).__name__
        check(pend == "IndexError" or pend is None, f"{ctx}: parent's pending error raised at its sync point ({pend})")
        try:
            vals = [g.cpu() for g in got]
        except Exception as ex:  # noqa: BLE001
            check(False, f"{ctx}: batches unreadable: {type(ex).__name__}")
        check(len(vals) == 2 and all(torch.equal(v, torch.full((4, 1024), 2.0)) for v in vals), f"{ctx}: batches before the error right ({len(vals)})")
        drain()
    done()
