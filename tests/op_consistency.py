"""Cross-layer op classification check: for each op, the C++ core, the compiler's passes, the cost model and the
profiler must say what the op table (runtime/optable.py) says, and what the device did must match it (an op the
C++ counters saw as executed is native, one they saw as a host fallback is not).

Used twice: over every op the test suite ran (conftest.py collects them and fails the session on a disagreement)
and over the whole table plus a sample of unlisted ATen ops (test_optable.py)."""
from __future__ import annotations

import torch

from torchneuron import _C
from torchneuron.runtime.optable import Rule, base_name, op_info

F32, I64 = torch.float32, torch.int64


def _specs(name: str) -> tuple[list, list]:
    """Small input and output (shape, dtype) lists that the op's cost rule can price."""
    rule, bwd = op_info(name).rule, base_name(name).endswith("backward")
    if rule is Rule.CONV:
        x, w, y = ((1, 2, 8, 8), F32), ((4, 2, 3, 3), F32), ((1, 4, 6, 6), F32)
        return ([y, x, w], [x, w]) if bwd else ([x, w], [y])
    if rule is Rule.ATTENTION:
        q = ((1, 2, 8, 4), F32)
        return ([q] * 4, [q] * 3) if bwd else ([q] * 3, [q])
    if rule is Rule.GATHER:
        return [((16, 8), F32), ((4,), I64)], [((4, 8), F32)]
    if rule is Rule.RNN:  # 5 steps, batch 3, input 4, hidden 6
        x, w_ih, w_hh, h, y = ((5, 3, 4), F32), ((24, 4), F32), ((24, 6), F32), ((3, 6), F32), ((5, 3, 6), F32)
        return ([x, w_ih, w_hh, y, h, h], [x, w_ih, w_hh]) if bwd else ([x, w_ih, w_hh, h, h], [y, h, h])
    if rule is Rule.SCATTER:
        return [((16, 8), F32), ((4,), I64), ((4, 8), F32)], [((16, 8), F32)]
    m = ((8, 8), F32)
    return [m] * 3, [m]


def _overload(name: str) -> torch._ops.OpOverload | None:
    ns, _, rest = name.partition("::")
    packet, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def disagreements(names: dict[str, str | None], executed: set[str] = frozenset(),
                  fallback: set[str] = frozenset()) -> list[str]:
    """One line per op and layer that disagrees with the op table. `names`: qualified op names ("aten::add_",
    "aten::add.Tensor") -> the engine the compiler classified it on when it compiled it (None: not compiled);
    `executed` / `fallback`: names the C++ counters saw run natively / as host fallbacks."""
    from torchneuron.compiler.passes import engine_of
    from torchneuron.costmodel.ops import op_cost
    from torchneuron.profiler import kineto
    from torchneuron.profiler.trace import ENGINES

    bad = []
    for name, compiled in sorted(names.items()):
        info = op_info(name)
        want = {"base": base_name(name), "native": info.native, "exact": info.exact,
                "host_tensors": info.host_tensors}
        if hasattr(_C, "_op_class"):
            got = dict(_C._op_class(name))
            if got != want:
                bad.append(f"{name}: C++ core {got} != op table {want}")
        if name in executed and not info.native:
            bad.append(f"{name}: the C++ core ran it natively but the op table says host fallback")
        if name in fallback and info.native:
            bad.append(f"{name}: the C++ core ran it as a host fallback but the op table says native")
        ov = _overload(name)
        if compiled is not None and compiled != info.engine:
            bad.append(f"{name}: the compiler classified it {compiled!r}, the op table says {info.engine!r}")
        if ov is not None and engine_of(ov) != info.engine:
            bad.append(f"{name}: compiler engine_of {engine_of(ov)!r} != op table {info.engine!r}")
        ins, outs = _specs(name)
        tensor = lambda specs: [(s, str(d).removeprefix("torch.")) for s, d in specs]  # noqa: E731
        try:
            cost = op_cost(name, tensor(ins), tensor(outs), "trn2").engine
            prof = kineto.cost([(name, False, ins, outs)])[0][2]
        except Exception as e:  # noqa: BLE001  (reported as a disagreement, with the op's name)
            bad.append(f"{name}: the cost model could not price it by rule {info.rule.value}: {e!r}")
            continue
        if cost != info.engine:
            bad.append(f"{name}: cost model engine {cost!r} != op table {info.engine!r}")
        if prof != info.engine or prof not in ENGINES:
            bad.append(f"{name}: profiler row {prof!r} != op table {info.engine!r}")
    return bad
