"""pickle.dumps / legacy torch.save of a poisoned neuron tensor (a failed index_select's result, its failure
already reported) hand back uncomputed bytes; torch.save (zipfile) raises, as every other host read does."""
import io
import pickle

import torch
from _pc import drain, failing

bad = failing()
drain()  # the IndexError is raised (and caught) here, as in a notebook cell
for name, fn in [("pickle.dumps", lambda: pickle.loads(pickle.dumps(bad))),
                 ("torch.save legacy", lambda: torch.save(bad, io.BytesIO(), _use_new_zipfile_serialization=False))]:
    try:
        v = fn()
    except IndexError as e:
        print(f"OK: {name} raised", str(e)[:80])
    else:
        print(f"BUG: {name} succeeded", "" if v is None else v.cpu().tolist())
