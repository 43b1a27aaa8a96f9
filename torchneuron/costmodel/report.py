"""Reports of an estimate: Markdown text, a time-breakdown chart and a roofline plot (PNG, matplotlib with the
Agg backend, imported only here), and an HTML page embedding them."""
from __future__ import annotations

import base64
import html as _html
import io
from pathlib import Path
from typing import BinaryIO

from .estimate import EstimateResult
from .ops import target

_VEC = "vector, scalar, gpsimd"
CATEGORY = {"tensor": "matmul / attention", "vector": _VEC, "scalar": _VEC, "gpsimd": _VEC,
            "dma": "data movement", "collective": "communication"}
COLORS = {"matmul / attention": "#3b6fb6", _VEC: "#f0a030", "data movement": "#8c8c8c",
          "communication": "#c0392b", "optimizer": "#27ae60"}
ENGINE_COLORS = {"tensor": "#3b6fb6", "vector": "#f0a030", "scalar": "#e67e22", "gpsimd": "#9b59b6",
                 "dma": "#8c8c8c", "collective": "#c0392b"}


def short(op: str) -> str:
    """Readable op names for charts: the fused attention kernels by what they are."""
    if op.startswith("_scaled_dot_product"):
        return "flash attention" + (" backward" if op.endswith("backward") else "")
    return op


def _category(op) -> str:
    return "optimizer" if op.phase == "optimizer" else CATEGORY.get(op.engine, _VEC)


def breakdown(r: EstimateResult) -> dict[str, float]:
    """Seconds per step by category of work."""
    out = dict.fromkeys(COLORS, 0.0)
    for o in r.ops:
        out[_category(o)] += o.time_s * o.count
    return out


def _platform(r: EstimateResult) -> str:
    return f"{r.cores} x {r.target} ({r.instance})"


def _money(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"${x:,.{digits}f}"


def _memory(e: EstimateResult) -> str:
    gib = f"{e.memory['total'] / 2**30:,.2f} of {e.memory['capacity'] / 2**30:,.0f} GiB"
    return gib + ("" if e.fits else " (does not fit)")


def _note(r: EstimateResult) -> str:
    runs = [r] + ([r.comparison] if r.comparison else [])
    prices = "; ".join(f"{e.instance} at {_money(e.price_per_hour)}/h ({e.price_source})" if e.price_per_hour
                       else f"{e.instance}: {e.price_source} (pass price_per_hour)" for e in runs)
    return (f"Prices: {prices}. Costs are pro rata for the cores used. All figures are modelled by "
            "torchneuron.costmodel (docs/costmodel.md lists the assumptions), not measured.")


def _rows(r: EstimateResult) -> list[tuple[str, ...]]:
    """(quantity, this estimate, the comparison) rows of the headline table."""
    step = "time per token" if r.mode == "decode" else "step time"
    fmt = [(step, lambda e: f"{e.step_time_s * 1e3:,.2f} ms"),
           (f"{r.unit} / s", lambda e: f"{e.items_per_s:,.0f}"),
           ("MFU", lambda e: f"{e.mfu:.1%}"),
           ("layout", lambda e: f"dp={e.dp} tp={e.tp}, {e.execution}"),
           ("cost / hour (estimate)", lambda e: _money(e.cost_per_hour)),
           (f"cost / million {r.unit}", lambda e: _money(e.cost_per_million, 4)),
           ("memory / core", _memory)]
    runs = [r] + ([r.comparison] if r.comparison else [])
    return [("", *(_platform(e) for e in runs))] + [(name, *(f(e) for e in runs)) for name, f in fmt]


def markdown(r: EstimateResult, title: str = "model", images: dict[str, str] | None = None) -> str:
    """The estimate as Markdown; `images` maps a caption to a relative PNG path to link."""
    what = {"train": "training step", "forward": "forward pass", "decode": "decode step"}[r.mode]
    rows = _rows(r)
    lines = [f"# Estimate: {title}, {what}", "", "| " + " | ".join(rows[0]) + " |",
             "|" + "---|" * len(rows[0])] + ["| " + " | ".join(row) + " |" for row in rows[1:]]
    lines += ["", _note(r), ""]
    for caption, path in (images or {}).items():
        lines += [f"![{caption}]({path})", ""]
    total = r.step_time_s
    lines += ["## Where the time goes", "", "| work | ms / step | share |", "|---|---|---|"]
    lines += [f"| {k} | {v * 1e3:,.3f} | {v / total:.1%} |" for k, v in breakdown(r).items() if v]
    lines += ["", "| phase | ms / step | share |", "|---|---|---|"]
    lines += [f"| {k} | {v * 1e3:,.3f} | {v / total:.1%} |" for k, v in r.by("phase").items() if v]
    lines += ["", "## Top ops (one core)", "", "| op | engine | ms / step | calls | bound | achieved |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {short(op)} | {eng} | {t * 1e3:,.3f} | {n} | {b} | {a:.0%} |"
              for op, eng, t, b, a, n in r.top(12)]
    lines += ["", "## Memory per core", "", "| kind | GiB |", "|---|---|"]
    lines += [f"| {k} | {v / 2**30:,.3f} |" for k, v in r.memory.items()]
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def time_chart(r: EstimateResult, path: str | Path | BinaryIO, title: str = "model") -> str | Path | BinaryIO:
    """Left: step time by kind of work on each platform. Right: the ops that take the most time."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.1, 1]})
    runs = [r] + ([r.comparison] if r.comparison else [])
    unit = 1e3 if max(e.step_time_s for e in runs) < 10 else 1.0
    label = "ms" if unit == 1e3 else "s"
    for y, e in enumerate(runs):
        x0 = 0.0
        for cat, secs in breakdown(e).items():
            if secs:
                left.barh(y, secs * unit, left=x0, color=COLORS[cat], label=None if y else cat, height=0.55)
                x0 += secs * unit
        left.text(x0, y, f"  {e.step_time_s * unit:,.1f} {label}\n  {e.items_per_s:,.0f} {e.unit}/s",
                  va="center", fontsize=9)
    left.set_yticks(range(len(runs)), [_platform(e) for e in runs], fontsize=9)
    left.invert_yaxis()
    left.set_xlabel(f"{label} per {'token' if r.mode == 'decode' else 'step'}")
    left.set_xlim(0, max(e.step_time_s for e in runs) * unit * 1.35)
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.45, -0.16), ncol=3, frameon=False)
    left.set_title(f"{title}: modelled {r.mode} step", fontsize=11)
    top = r.top(10)[::-1]
    right.barh(range(len(top)), [t * unit for _, _, t, *_ in top],
               color=[ENGINE_COLORS.get(eng, "#999") for _, eng, *_ in top])
    right.set_yticks(range(len(top)), [f"{short(op)} ({b})" for op, _, _, b, *_ in top], fontsize=8)
    right.set_xlabel(f"{label} per step on one {r.target} core")
    right.set_title("top ops (colour: engine, in brackets: bound)", fontsize=11)
    for side in (left, right):
        side.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path


def roofline(r: EstimateResult, path: str | Path | BinaryIO, title: str = "model") -> str | Path | BinaryIO:
    """Each op (per distinct shape) at its arithmetic intensity and achieved FLOP/s, under the core's TensorE
    and vector ceilings and the HBM bandwidth slope; marker area is its share of the step."""
    plt = _pyplot()
    t = target(r.target, r.lnc)
    pts: dict[tuple[str, str, str], list[float]] = {}
    for o in r.ops:
        if o.flops > 0 and o.bytes > 0 and o.time_s > 0 and o.engine != "collective":
            p = pts.setdefault((o.op, o.shapes, o.engine), [0.0, 0.0, 0.0])
            p[0] += o.flops * o.count
            p[1] += o.bytes * o.count
            p[2] += o.time_s * o.count
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    peak, vec, bw = t.matmul_flops("bfloat16"), t.engine_rate("vector", 2), t.hbm_bw
    lo = min([p[0] / p[1] for p in pts.values()] + [0.05]) / 2
    hi = max([p[0] / p[1] for p in pts.values()] + [peak / bw * 4]) * 2
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak, bw * x) for x in grid], color="#222", lw=1.6,
            label=f"TensorE bf16 {peak / 1e12:.0f} TF/s")
    ax.plot(grid, [min(vec, bw * x) for x in grid], color="#f0a030", lw=1.2, ls="--",
            label=f"vector engine {vec / 1e12:.2f} T elem/s")
    ax.plot(grid, [bw * x for x in grid], color="#888", lw=0.8, ls=":", label=f"HBM {bw / 1e9:,.0f} GB/s")
    total = sum(p[2] for p in pts.values()) or 1.0
    ranked = sorted(pts.items(), key=lambda kv: -kv[1][2])
    for (_, _, eng), (flops, nbytes, secs) in ranked:
        ax.scatter(flops / nbytes, flops / secs, s=20 + 900 * secs / total, alpha=0.6, edgecolors="white",
                   color=ENGINE_COLORS.get(eng, "#999"), linewidths=0.5)
    named: set[str] = set()
    for (op, _, _), (flops, nbytes, secs) in ranked:
        if short(op) not in named and len(named) < 5:
            named.add(short(op))
            ax.annotate(short(op), (flops / nbytes, flops / secs), fontsize=7, ha="right",
                        xytext=(-6, -12 * len(named)), textcoords="offset points",
                        arrowprops={"arrowstyle": "-", "color": "#999", "lw": 0.5})
    for eng, color in ENGINE_COLORS.items():
        if eng != "collective" and any(k[2] == eng for k in pts):
            ax.scatter([], [], color=color, label=f"{eng} ops")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(max(min([p[0] / p[2] for p in pts.values()] + [peak / 1e4]) / 3, peak / 1e6), peak * 3)
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("achieved FLOP/s (one core)")
    ax.set_title(f"{title}: roofline of one {r.target} core (LNC={r.lnc})", fontsize=11)
    ax.legend(fontsize=8, loc="lower right", frameon=False)
    ax.grid(True, which="major", alpha=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path


def html(r: EstimateResult, path: str | Path, title: str = "model") -> Path:
    """A self-contained page: the headline table, both charts (embedded), top ops and memory."""
    path = Path(path)
    charts = [chart(r, io.BytesIO(), title).getvalue() for chart in (time_chart, roofline)]
    imgs = "".join(f'<img src="data:image/png;base64,{base64.b64encode(png).decode()}" alt="chart">'
                   for png in charts)
    esc = _html.escape

    def table(rows: list[tuple[str, ...]]) -> str:
        head = "".join(f"<th>{esc(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in rows[1:])
        return f"<table><tr>{head}</tr>{body}</table>"

    top = [("op", "engine", "ms / step", "bound", "achieved", "calls")] + [
        (short(op), eng, f"{t * 1e3:,.3f}", b, f"{a:.0%}", str(n)) for op, eng, t, b, a, n in r.top(12)]
    mem = [("kind", "GiB")] + [(k, f"{v / 2**30:,.3f}") for k, v in r.memory.items()]
    what = {"train": "training step", "forward": "forward pass", "decode": "decode step"}[r.mode]
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)} estimate</title><style>"
            "body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;color:#222}"
            "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px;"
            "text-align:right}td:first-child,th:first-child{text-align:left}img{max-width:100%;display:block;"
            f"margin:1em 0}}</style></head><body><h1>{esc(title)}: {what}</h1>{table(_rows(r))}"
            f"<p>{esc(_note(r))}</p>{imgs}<h2>Top ops (one core)</h2>{table(top)}"
            f"<h2>Memory per core</h2>{table(mem)}</body></html>")
    path.write_text(page)
    return path


def write(r: EstimateResult, path: str | Path, title: str = "model") -> list[Path]:
    """`x.md`: Markdown, with x.time.png and x.roofline.png beside it; `x.html`: one self-contained page."""
    path = Path(path)
    if path.suffix == ".html":
        return [html(r, path, title)]
    charts = [path.with_suffix(".time.png"), path.with_suffix(".roofline.png")]
    time_chart(r, charts[0], title)
    roofline(r, charts[1], title)
    path.write_text(markdown(r, title, {"time breakdown": charts[0].name, "roofline": charts[1].name}))
    return [path, *charts]
