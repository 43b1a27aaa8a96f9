"""A script that ends while a side stream waits (wait_stream / wait_event) for the default stream's still-queued work
does not exit: the exit drain waits the whole TORCHNEURON_EXIT_TIMEOUT (60 s by default), then ends the process with
status 1 and "queued work did not finish ... on neuron:0 stream 65" — with no kernel error at all ("plain"), and with
a failing kernel ("failing") whose IndexError is then never printed. The same wait queued after the producer's work
has finished exits at once. Expected: exit as soon as the ~0.2 s of queued work is done; status 0 (plain) or 1 with
the IndexError on stderr (failing). Run: TORCHNEURON_EXIT_TIMEOUT=5 python p32_exit_with_waiting_stream.py plain"""
import sys

import torch
from _pc import failing, slow

side = torch.neuron.Stream()
if sys.argv[1:] == ["failing"]:
    bad = failing()  # queued behind ~0.2 s of matmuls; fails on the worker
else:
    slow()  # ~0.2 s of matmuls queued, nothing fails
side.wait_stream(torch.neuron.current_stream())
print("end of script", flush=True)
