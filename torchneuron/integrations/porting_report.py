"""The porting report of a run under CUDA compatibility mode: what was redirected (by API, with call sites),
what ran on `neuron` and what fell back to the host, dtype-policy events, graph breaks and recompiles, and the NKI
kernels called with their modelled time and bottleneck.
Text by default; `write(path)` picks JSON or Markdown by the suffix ("-" prints text)."""
from __future__ import annotations

import json
import sys
from typing import Any

import torch

from ..runtime.tracking import get_dtype_events, get_executed_ops, get_fallback_ops, get_fusion_counts
from . import cuda_compat


def collect() -> dict[str, Any]:
    """The report as data."""
    graphs = torch.neuron.get_dynamo_metrics()
    return {
        "compat_enabled": cuda_compat.is_enabled(),
        "redirects": cuda_compat.redirects(),
        "executed_ops": get_executed_ops(),
        "fallback_ops": get_fallback_ops(),
        "dtype_events": get_dtype_events(),
        "eager_fusion": {**get_fusion_counts(), **_fusion_compiles()},
        "memory": {f"neuron:{i}": {"max_allocated": torch.neuron.max_memory_allocated(i),
                                   "max_reserved": torch.neuron.max_memory_reserved(i)}
                   for i in range(torch.neuron.device_count())},
        "compiled_graphs": [{k: g.get(k) for k in ("name", "nodes", "recompiles", "graph_break", "fallback", "error")}
                            for g in graphs],
        "nki_kernels": _nki_kernels(),
    }


def _fusion_compiles() -> dict[str, Any]:
    """Eager fusion's compile work in this process, and the groups it left unfused (failed, or past the budget)."""
    from ..compiler import eager_fusion

    st = eager_fusion.stats()
    return {"compiled": st.compiled, "compile_seconds": round(st.compile_seconds, 3), "failures": st.failures,
            "over_budget": st.over_budget, "last_failure": st.last_failure}


def _nki_kernels() -> dict[str, dict[str, Any]]:
    """NKI kernels called on neuron: calls, modelled time, bottleneck engine (their own timelines, docs/nki.md)."""
    if "torchneuron.nki.kernel" not in sys.modules:
        return {}
    from ..nki.kernel import CALLS

    return {name: {"calls": c.calls, "modelled_s": c.modelled_s, "bottleneck": c.bottleneck,
                   "utilisation": c.utilisation} for name, c in CALLS.items()}


def _top(d: dict[str, int], n: int = 10) -> str:
    items = sorted(d.items(), key=lambda kv: -kv[1])
    more = f", ... {len(items) - n} more" if len(items) > n else ""
    return ", ".join(f"{k} x{v}" for k, v in items[:n]) + more


def _fusion_line(f: dict[str, Any]) -> str:
    line = f"eager fusion: {f['kernels']} fused kernels ran {f['ops']} queued ops"
    if f.get("compiled"):
        line += f"; {f['compiled']} kernels compiled in {f['compile_seconds']:.1f} s"
    if f.get("over_budget"):
        line += (f"; {f['over_budget']} groups ran unfused, the compile budget spent (raise "
                 "TORCHNEURON_FUSION_COMPILE_BUDGET)")
    if f.get("failures"):
        line += f"; {f['failures']} groups ran unfused, not compilable (last: {f['last_failure']})"
    return line


def _sections(r: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(title, lines) shared by the text and Markdown renderings."""
    red = [f"{api}: {sum(sites.values())}  " + ", ".join(f"{site} x{n}" for site, n in sites.items())
           for api, sites in r["redirects"].items()] or ["none"]
    ops = [f"executed on neuron: {sum(r['executed_ops'].values())} calls of {len(r['executed_ops'])} ops"
           + (f" ({_top(r['executed_ops'])})" if r["executed_ops"] else ""),
           f"host fallbacks: {sum(r['fallback_ops'].values())}"
           + (f" ({_top(r['fallback_ops'])})" if r["fallback_ops"] else ""),
           _fusion_line(r["eager_fusion"])]
    mem = [f"{d}: peak {m['max_allocated'] / 2**20:.2f} MiB allocated" for d, m in r["memory"].items()
           if m["max_allocated"]] or ["no device memory used"]
    graphs = [f"{g['name']}: {g['nodes']} nodes, {g['recompiles']} recompiles"
              + (f", graph break: {g['graph_break']}" if g["graph_break"] else "")
              + (f", fallback: {g['fallback']}" if g["fallback"] else "") for g in r["compiled_graphs"]] or ["none"]
    nki = [f"{name}: {k['calls']} calls, {k['modelled_s'] * 1e6:,.1f} us modelled in all, bottleneck "
           f"{k['bottleneck']} ({k['utilisation']:.0%} busy)" for name, k in r.get("nki_kernels", {}).items()]
    return [(f"CUDA calls redirected ({sum(sum(s.values()) for s in r['redirects'].values())})", red),
            ("Ops", ops), ("Dtype-policy events", [_top(r["dtype_events"]) or "none"]), ("Memory", mem),
            ("Compiled graphs", graphs), *([("NKI kernels", nki)] if nki else [])]


def render_text(r: dict[str, Any]) -> str:
    lines = ["torchneuron porting report" + ("" if r["compat_enabled"] else " (compatibility mode was off)")]
    for title, body in _sections(r):
        lines += [f"  {title}", *(f"    {b}" for b in body)]
    return "\n".join(lines) + "\n"


def render_markdown(r: dict[str, Any]) -> str:
    out = ["# torchneuron porting report", ""]
    for title, body in _sections(r):
        out += [f"## {title}", "", *(f"- {b}" for b in body), ""]
    return "\n".join(out)


def write_at_exit(dest: str) -> None:
    """TORCHNEURON_PORTING_REPORT's write at exit. Under torchrun every process runs it: each rank of a run of
    several writes its own file (`port.json` -> `port.rank1.json`), and torchrun's launcher, which imports torch but
    runs no script, writes none (it exited last and left an empty report where the ranks' had been)."""
    from ..hardware.config import torchrun_rank

    rank, world = torchrun_rank()
    main_module = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", "")
    if rank is None and ("torch.distributed.run" in sys.modules or main_module.startswith("torch.distributed.")):
        return  # torchrun, `python -m torch.distributed.run` or `.launch`: the launcher
    if rank is not None and world > 1 and dest != "-":
        stem, dot, ext = dest.rpartition(".")
        dest = f"{stem}.rank{rank}.{ext}" if dot and "/" not in ext else f"{dest}.rank{rank}"
    write(dest)


def write(dest: str, r: dict[str, Any] | None = None) -> None:
    """Write the report to `dest`: *.json, *.md, any other path as text, "-" to stdout."""
    r = collect() if r is None else r
    if dest == "-":
        sys.stdout.write(render_text(r))
        sys.stdout.flush()
        return
    body = (json.dumps(r, indent=1) if dest.endswith(".json") else
            render_markdown(r) if dest.endswith(".md") else render_text(r))
    with open(dest, "w") as f:
        f.write(body)
