"""A kernel failure that has already happened (the stream worker ran it long ago) is not printed at exit when the
exit drain then times out on other queued work (a daemon thread launching in a loop): stderr has only the
"did not finish within T s" line. Expected (issue 26): the pending IndexError (op, launching line) is printed to
stderr as well, status non-zero. Run with TORCHNEURON_EXIT_TIMEOUT=3 to keep it short."""
import threading
import time

import torch
from _pc import DEV, failing

bad = failing()  # fails on the worker ~0.2 s from now
time.sleep(1.0)  # it has failed by now: the error is pending


def launch_forever() -> None:
    x = torch.ones(512, 512, device=DEV)
    while True:
        x = (x @ x).tanh()


threading.Thread(target=launch_forever, daemon=True).start()
time.sleep(0.5)
print("exiting", flush=True)
