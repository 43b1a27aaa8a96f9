"""The per-engine timeline of one NKI kernel call: each instruction is placed on its engine (Tensor, Vector, Scalar,
GpSimd) or on one of the core's DMA queues, after the instructions it depends on (read-after-write,
write-after-read and write-after-write on overlapping regions of the same memory), as the hardware's semaphores
order them; engines otherwise run in parallel. Durations use the documented cost rules (docs/nki.md), with the
constants of hardware/chips.py."""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..hardware.chips import Chip

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


@dataclass(frozen=True)
class Instruction:
    """One placed instruction (times in seconds from the kernel's start)."""

    name: str
    engine: str
    start: float
    end: float
    line: int


@dataclass
class KernelProfile:
    """What a kernel call cost on the modelled chip: `latency_s`, per-engine busy time and utilisation, the
    bottleneck engine, instruction counts and the DMA traffic."""

    kernel: str
    chip: str
    latency_s: float
    busy_s: dict[str, float]
    instructions: dict[str, int]
    dma_bytes: int
    matmul_flops: int
    timeline: list[Instruction] = field(repr=False, default_factory=list)

    @property
    def utilisation(self) -> dict[str, float]:
        return {e: (b / self.latency_s if self.latency_s else 0.0) for e, b in self.busy_s.items()}

    @property
    def bottleneck(self) -> str:
        return max(self.busy_s, key=self.busy_s.get) if self.busy_s else "none"

    def report(self) -> str:
        rows = [f"NKI kernel {self.kernel} on {self.chip}: {self.latency_s * 1e6:,.2f} us modelled, "
                f"bottleneck {self.bottleneck}"]
        for e in ENGINES:
            rows.append(f"  {e:<7} {self.instructions.get(e, 0):>8} instr  busy {self.busy_s.get(e, 0.0) * 1e6:>12,.2f}"
                        f" us  {self.utilisation.get(e, 0.0):6.1%}")
        rows.append(f"  DMA traffic {self.dma_bytes / 1e6:,.3f} MB, matmul {self.matmul_flops / 1e9:,.3f} GFLOP")
        return "\n".join(rows)

    def chrome_trace(self) -> dict[str, Any]:
        """The timeline as a Chrome trace (chrome://tracing, Perfetto): one row per engine."""
        tid = {e: i for i, e in enumerate(ENGINES)}
        events = [{"name": i.name, "ph": "X", "pid": 0, "tid": tid[i.engine], "ts": i.start * 1e6,
                   "dur": (i.end - i.start) * 1e6, "args": {"line": i.line}} for i in self.timeline]
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": e}} for e, t in tid.items()]
        return {"traceEvents": events, "displayTimeUnit": "ns"}


def _overlap(a: tuple, b: tuple) -> bool:
    return all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _covers(a: tuple, b: tuple) -> bool:
    return all(x0 <= y0 and y1 <= x1 for (x0, x1), (y0, y1) in zip(a, b, strict=True))


@dataclass
class _Pending:
    """The last instruction issued, not placed yet: the memory it reads and writes as (allocation, box) pairs held
    weakly (a temporary it touches is not kept alive by the timeline), and how to place it."""

    name: str
    engine: str
    reads: list
    writes: list
    result: Any  # weakref to the one tile it wrote, which `retarget` may redirect
    place: Any  # (reads, writes, when its inputs are ready) -> None
    ready: float  # when what it reads was written (known at issue: a temporary it reads may die before placing)


def _accesses(tiles: list) -> list:
    return [(weakref.ref(t.alloc), t.box()) for t in tiles]


class Timeline:
    """Places instructions; `profile()` summarises them. The last instruction is placed when the next one is issued
    (or at `profile`), so that `t[...] = instr(...)` can make it write `t` directly (`retarget`), as AWS's compiler
    does, instead of through a temporary and a copy."""

    KEEP = 200_000  # instructions kept for the trace (all are counted)

    def __init__(self, chip: Chip, name: str):
        self.chip, self.name = chip, name
        self.free = dict.fromkeys(ENGINES[:-1], 0.0)
        self.queues = [0.0] * chip.dma_engines
        self.dma_bw_free = 0.0
        self.busy = dict.fromkeys(ENGINES, 0.0)
        self.count = dict.fromkeys(ENGINES, 0)
        self.end = 0.0
        self.dma_bytes = self.flops = 0
        self.records: list[Instruction] = []
        self.regions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Allocation -> [[box, w, r]]
        self.pending: _Pending | None = None

    # ---- the last instruction
    def _hold(self, name: str, engine: str, reads: list, writes: list, place: Any) -> None:
        self.flush()
        result = weakref.ref(writes[0]) if len(writes) == 1 else None
        ready = self._ready([(t.alloc, t.box()) for t in reads], [])
        self.pending = _Pending(name, engine, _accesses(reads), _accesses(writes), result, place, ready)

    def flush(self) -> None:
        """Place the held instruction (its memory that died since is no longer tracked)."""
        p, self.pending = self.pending, None
        if p is not None:
            live = lambda acc: [(a, box) for r, box in acc if (a := r()) is not None]  # noqa: E731
            p.place(live(p.reads), live(p.writes), p.ready)

    def held_engine(self, tile: Any) -> str | None:
        """The engine of the held instruction if it wrote exactly `tile` (and nothing else), else None."""
        p = self.pending
        return p.engine if p is not None and p.result is not None and p.result() is tile else None

    def retarget(self, tile: Any, dst: Any) -> None:
        """The held instruction, which wrote exactly `tile` (`held_engine`), writes `dst` too: where the compiler
        places it. `tile` keeps its write, so a later read of it (a result kept in a name) still waits for it."""
        p = self.pending
        assert p is not None and p.result is not None and p.result() is tile
        p.writes, p.result = _accesses([dst]) + p.writes, None

    # ---- dependencies
    def _ready(self, reads: list, writes: list) -> float:
        t = 0.0
        for alloc, box in reads:
            for b, w, _ in self.regions.get(alloc, ()):
                if w > t and _overlap(b, box):
                    t = w
        for alloc, box in writes:
            for b, w, r in self.regions.get(alloc, ()):
                if max(w, r) > t and _overlap(b, box):
                    t = max(w, r)
        return t

    def _record(self, reads: list, writes: list, end: float) -> None:
        for alloc, box in reads:
            if not alloc.written:
                continue
            entries = self.regions.setdefault(alloc, [])
            for e in entries:
                if e[0] == box:
                    e[2] = max(e[2], end)
                    break
            else:
                entries.append([box, 0.0, end])
        for alloc, box in writes:
            alloc.written = True
            entries = self.regions.setdefault(alloc, [])
            last_read = 0.0
            keep = []
            for e in entries:
                if _covers(box, e[0]):
                    last_read = max(last_read, e[2])
                else:
                    keep.append(e)
            keep.append([box, end, last_read])
            self.regions[alloc] = keep

    # ---- placement
    def compute(self, name: str, engine: str, cycles: float, reads: list, writes: list, line: int,
                flops: int = 0) -> None:
        def place(reads: list, writes: list, ready: float) -> None:
            dur = cycles / getattr(self.chip, engine).clock_hz
            start = max(ready, self._ready([], writes), self.free[engine])
            end = start + dur
            self.free[engine] = end
            self._place(name, engine, start, end, dur, line)
            self.flops += flops
            self._record(reads, writes, end)
        self._hold(name, engine, reads, writes, place)

    def dma(self, name: str, nbytes: int, row_bytes: int, reads: list, writes: list, line: int,
            efficiency: float = 1.0) -> None:
        def place(reads: list, writes: list, ready: float) -> None:
            chip = self.chip
            q = min(range(len(self.queues)), key=self.queues.__getitem__)
            start = max(ready, self._ready([], writes), self.queues[q])
            eff = efficiency * row_bytes / (row_bytes + chip.dma_row_overhead_bytes)
            xfer = nbytes / (chip.dma_bw_per_core * eff)
            xfer_start = max(start, self.dma_bw_free)
            self.dma_bw_free = xfer_start + xfer
            end = self.dma_bw_free + chip.dma_fixed_s
            self.queues[q] = end
            self._place(name, "dma", start, end, xfer, line)
            self.dma_bytes += nbytes
            self._record(reads, writes, end)
        self._hold(name, "dma", reads, writes, place)

    def _place(self, name: str, engine: str, start: float, end: float, busy: float, line: int) -> None:
        self.busy[engine] += busy
        self.count[engine] += 1
        self.end = max(self.end, end)
        if len(self.records) < self.KEEP:
            self.records.append(Instruction(name, engine, start, end, line))

    def profile(self) -> KernelProfile:
        self.flush()
        return KernelProfile(self.name, self.chip.name, self.end, dict(self.busy), dict(self.count),
                             self.dma_bytes, self.flops, self.records)


# ---------------------------------------------------------------------------------------------- cost rules
def engine_cycles(chip: Chip, engine: str, free: int, itemsize: int, inputs: int = 1) -> float:
    """Vector/Scalar/GpSimd: a fixed start (S12: ~60 cycles per SBUF/PSUM access) plus the elements per partition
    over the engine's per-partition rate (wider datapaths for 16/8-bit data on v3/v4), at least the 64-cycle
    minimum initiation interval; two-input Vector instructions stream both inputs (S12)."""
    eng = getattr(chip, engine)
    per_cycle = max(1.0, eng.rate(itemsize) / eng.clock_hz / 128)
    work = free * inputs / per_cycle
    fixed = chip.gpsimd_fixed_cycles if engine == "gpsimd" else chip.instr_cycles
    return fixed + max(work, chip.mm_min_cycles)


def matmul_cycles(chip: Chip, moving_free: int, fp32: bool) -> float:
    """TensorE issues a matmul every max(moving free size, 64) cycles; fp32 operands cost 4x (S12)."""
    return max(moving_free, chip.mm_min_cycles) * (chip.fp32_slowdown if fp32 else 1)


def row_bytes(tile: Any) -> int:
    """Contiguous bytes per partition (row) of a DMA's access, the DMA efficiency's measure."""
    data = tile.data
    if data.dim() == 0:
        return data.element_size()
    run = data.element_size()
    for size, stride in zip(reversed(data.shape), reversed(data.stride()), strict=True):
        if stride * data.element_size() != run and size > 1:
            break
        run *= size
    return max(data.element_size(), min(run, math.prod(data.shape[1:] or (1,)) * data.element_size()))
