"""zero_() / fill_() / nn.init.zeros_ of a whole poisoned tensor raise the old IndexError ("aten::fill_ reads memory
that was never computed") although they write every element and read none; normal_() and copy_() over it clear the
poison. Expected (issue 26: "overwriting them clears it"): zero_/fill_ clear it too, so a notebook can reset a
buffer (or `optimizer.zero_grad(set_to_none=False)` a poisoned grad) without a restart."""
import torch
from _pc import drain, failing

for name, f in [("normal_", lambda t: t.normal_()), ("copy_", lambda t: t.copy_(torch.zeros(2, 4))),
                ("zero_", lambda t: t.zero_()), ("fill_", lambda t: t.fill_(3.0))]:
    bad = failing()
    drain()  # the IndexError raised once
    try:
        f(bad)
        bad.cpu()
        print(f"OK: {name} cleared the poison")
    except IndexError:
        print(f"BUG: {name} raised IndexError")
