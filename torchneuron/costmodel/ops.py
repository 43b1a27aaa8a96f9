"""Op costs as pure functions of (op, shapes, dtypes, target): the engine that runs the op, its FLOPs and HBM
bytes, and its modelled time, bound and fraction of peak.

The engine and the cost rule of an op come from the op table (runtime/optable.py, which the device, the compiler
and the profiler read too); an op missing from it is a host fallback, priced as a VectorE sweep. The rules:
- TensorE (matmul, conv, attention): the 128x128 systolic array. A matmul pass takes a stationary tile of
  K<=128 (256 for fp8 double-row) contraction rows x <=128 output columns and streams a moving tile of <=512
  (one PSUM bank); it issues every max(moving free size, 64) cycles and larger K accumulates in PSUM. Partial
  tiles cost as much as full ones, so utilisation falls with M, N or K below a multiple of the tile. fp32
  costs 4x. The orientation (which operand is stationary) is the cheaper one.
- VectorE / ScalarE / GpSimd (elementwise, activations, reductions, indexing): `passes` sweeps of the datapath
  over the largest tensor (one input ~N cycles, two inputs ~2N), plus ~60 cycles per instruction.
- DMA (copies, concatenation): bandwidth-bound data movement. Free ops (metadata, allocation) cost nothing.
- Every op also moves its inputs and outputs through HBM; a tiled matmul re-reads operands when they do not
  fit in SBUF (the Hong-Kung bound 2MNK/sqrt(SBUF)). Engines, DMA and HBM overlap: an op takes the longest.
- A kernel pays a fixed cost (two DMA transfers that cannot overlap: ~1.3 us each); an eager op also pays a
  launch. A compiled graph runs fused kernels: see kernel_time.
Sources of every constant: torchneuron/hardware/chips.py and docs/costmodel.md.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..hardware.chips import CHIPS, GPU_INSTANCES, GPUS, INSTANCES, NXD_MOE_BLOCK, Chip, Gpu
from ..runtime.optable import Rule, base_name, op_info

ITEMSIZE = {"float64": 8, "complex64": 8, "int64": 8, "uint64": 8, "float32": 4, "int32": 4, "uint32": 4,
            "bfloat16": 2, "float16": 2, "int16": 2, "uint16": 2, "int8": 1, "uint8": 1, "bool": 1}


class T(NamedTuple):
    """A tensor as the cost model sees it."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return 1 if self.dtype.startswith("float8") else ITEMSIZE.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def dtype_class(dtype: str) -> str:
    """The tensor-engine rate class: bf16/fp16 run at the full rate, fp8 may run faster, fp32 (and integers,
    which the matmul datapath converts to fp32: S10) at a quarter."""
    if dtype.startswith("float8"):
        return "float8"
    return "bfloat16" if dtype in ("bfloat16", "float16") else "float32"


def datapath(engine: str) -> str:
    """The engine whose rates price an op: its own, VectorE for a host fallback (what neuronx-cc lowers it to)."""
    return "vector" if engine == "host" else engine


class Work(NamedTuple):
    """What a cost rule computes for one op: its FLOPs (elements for the vector-like engines), the busy time of its
    engine, its compulsory HBM bytes, its HBM bytes when run alone, and the peak FLOP/s of its engine (0 where
    FLOPs are not the measure)."""

    flops: float
    compute_s: float
    io_bytes: float
    bytes: float
    peak_flops: float = 0.0


@dataclass(frozen=True)
class Target:
    """One logical NeuronCore (`lnc` physical cores acting as one) or one GPU: the rates the rules use."""

    name: str
    spec: Chip | Gpu
    lnc: int = 1

    @property
    def is_neuron(self) -> bool:
        return isinstance(self.spec, Chip)

    @property
    def hbm_bw(self) -> float:
        """Streaming bandwidth between HBM and one core: its share of the chip's HBM, capped by its DMA."""
        s = self.spec
        if isinstance(s, Chip):
            return min(s.hbm_bw / s.physical_cores, s.dma_bw_per_core) * self.lnc
        return s.hbm_bw * s.hbm_efficiency  # what a streaming kernel reaches (G2)

    @property
    def hbm_bytes(self) -> int:
        return self.spec.core_hbm(self.lnc) if isinstance(self.spec, Chip) else self.spec.hbm_bytes

    @property
    def sbuf_bytes(self) -> int:
        return self.spec.sbuf_bytes * self.lnc

    @property
    def kernel_s(self) -> float:
        return 2 * self.spec.dma_fixed_s if isinstance(self.spec, Chip) else self.spec.kernel_s

    @property
    def launch_s(self) -> float:
        return self.spec.launch_s

    @property
    def busbw(self) -> float:
        """Achieved collective bus bandwidth of one rank inside an instance (the chip's links are shared by
        its logical cores)."""
        s = self.spec
        per_rank = s.link_bw / s.logical_cores(self.lnc) if isinstance(s, Chip) else s.link_bw
        return per_rank * s.fabric.efficiency

    def matmul_flops(self, dclass: str) -> float:
        """TensorE's rate from the clock and the array; a GPU's dense peak times its measured matmul efficiency
        (G1). Shape effects come on top (tiles on Trainium, waves on a GPU)."""
        s = self.spec
        if isinstance(s, Chip):
            return s.tensor_flops(dclass) * self.lnc
        return s.peak_flops[dclass] * s.mm_efficiency.get(dclass, 1.0)

    def marketed_flops(self, dclass: str = "bfloat16") -> float:
        """The vendor's dense peak, the MFU denominator."""
        return self.spec.peak_flops[dclass] * self.lnc

    def engine_rate(self, engine: str, itemsize: int) -> float:
        """Elements per second of a vector-like engine (a host fallback is priced on VectorE)."""
        s = self.spec
        if isinstance(s, Chip):
            return getattr(s, datapath(engine)).rate(itemsize) * self.lnc
        return s.vector_flops  # a GPU's CUDA cores: one element per FP32 FLOP


def target(name: str | Target = "trn2", lnc: int | None = None) -> Target:
    """`trn1`/`trn2`/`trn3`, `h100`, or an instance name (trn2.48xlarge, p5.48xlarge)."""
    if isinstance(name, Target):
        return name
    if name in INSTANCES:
        name = INSTANCES[name].chip
    if name in GPU_INSTANCES:
        name = GPU_INSTANCES[name].gpu
    if name in GPUS:
        return Target(name, GPUS[name])
    if name not in CHIPS:
        raise ValueError(f"unknown target {name!r}: choose one of {', '.join([*CHIPS, *GPUS])} or an "
                         "instance name")
    chip = CHIPS[name]
    lnc = chip.default_lnc if lnc is None else lnc
    if lnc not in chip.lnc_options:
        raise ValueError(f"LNC={lnc} is not valid on {chip.name}: choose {chip.lnc_options}")
    return Target(name, chip, lnc)


@dataclass(frozen=True)
class OpCost:
    """The modelled cost of one op on one core. `compute_s` is the busy time of its engine, `memory_s` the
    time of its HBM traffic when it runs alone, `overhead_s` the fixed kernel / launch cost it pays."""

    op: str
    engine: str  # an op table engine (tensor | vector | scalar | gpsimd | dma | free | host), collective, none
    flops: float
    bytes: float  # HBM traffic when run alone (compulsory inputs and outputs, plus tiled re-reads)
    io_bytes: float  # compulsory part: inputs read once, outputs written once
    compute_s: float
    memory_s: float
    overhead_s: float
    peak_flops: float  # of the engine at this dtype (0 where FLOPs are not the measure)
    peak_bw: float  # bandwidth its traffic moves at: HBM, or the collective bus bandwidth

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def bound(self) -> str:
        """What limits the op: compute, memory, communication, or fixed overhead (launch, latency)."""
        if self.engine == "collective":
            return "communication"
        if self.overhead_s > max(self.compute_s, self.memory_s):
            return "overhead"
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def achieved(self) -> float:
        """Fraction of the binding resource's peak reached over the op's whole time (FLOP/s for TensorE
        compute, the bandwidth otherwise)."""
        if not self.time_s:
            return 0.0
        if self.bound == "compute" and self.peak_flops:
            return self.flops / self.time_s / self.peak_flops
        if self.bound == "compute" and self.compute_s:
            return self.compute_s / self.time_s
        return self.bytes / self.time_s / self.peak_bw


# ---------------------------------------------------------------------------------------------- TensorE


def pe_cycles(m: int, k: int, n: int, chip: Chip, dclass: str) -> int:
    """Cycles of one [m,k]x[k,n] matmul on one systolic array, the cheaper of the two orientations."""
    rows, cols = chip.k_per_pass.get(dclass, chip.pe_rows), chip.pe_cols
    free, floor = chip.psum_free_max, chip.mm_min_cycles
    best = math.inf
    for stat, mov in ((m, n), (n, m)):
        full, rem = divmod(mov, free)
        per_pass = full * max(free, floor) + (max(rem, floor) if rem else 0)
        best = min(best, math.ceil(k / rows) * math.ceil(stat / cols) * per_pass)
    return best * (chip.fp32_slowdown if dclass == "float32" else 1)


GPU_TILE = 128  # output tile of one thread block of a Hopper/Blackwell GEMM (128 x 128)


def _gemm_s(b: int, m: int, k: int, n: int, t: Target, dclass: str) -> float:
    if t.is_neuron:  # the lnc physical arrays split the work evenly
        return b * pe_cycles(m, k, n, t.spec, dclass) / t.spec.tensor.clock_hz / t.lnc
    # A GPU GEMM runs its output tiles, one per SM at a time, in waves over the SMs: a partial wave costs a whole
    # one (wave quantization, G11), the first one too when there are fewer tiles than SMs (no split-K: idle SMs add
    # no tensor throughput; docs/costmodel.md, "Outliers"). HBM streaming is not scaled down with the SMs.
    tiles, sms = b * math.ceil(m / GPU_TILE) * math.ceil(n / GPU_TILE), t.spec.sms
    waves = tiles / (math.ceil(tiles / sms) * sms)
    return 2 * b * m * k * n / t.matmul_flops(dclass) / waves


def _reread_bytes(b: int, m: int, k: int, n: int, itemsize: int, t: Target) -> float:
    """HBM traffic lower bound of a tiled matmul whose operands do not fit on chip."""
    return b * 2 * m * n * k * itemsize / math.sqrt(t.sbuf_bytes / itemsize)


_DIMS = {"a": "bmk", "b": "bkn", "c": "bmn"}


def _mixed_class(a: T, b: T) -> str:
    """The rate class of a matmul of two operands: their own when they agree; 16-bit math when one is 8-bit
    weights and the other 16-bit activations (weight-only quantization dequantizes on the way in); else fp32."""
    if a.dtype == b.dtype:
        return dtype_class(a.dtype)
    if sorted((a.itemsize, b.itemsize)) == [1, 2] and "bfloat16" in (dtype_class(a.dtype), dtype_class(b.dtype)):
        return "bfloat16"
    return "float32"


def input_share(op: str, ins: Sequence[T], pos: int, attrs: Mapping | None = None) -> float:
    """The fraction of input `pos` an op reads from HBM: a grouped GEMM's [M, K] rows each meet one of its E
    experts [E, K, N], so it reads at most min(E, M) of them (or the `experts_loaded` its attrs name: nxd_moe);
    every other input is read whole. The one rule for both an eager op's traffic and a compiled kernel's
    (Coster.times)."""
    if base_name(op) == "_grouped_mm" and pos == 1 and len(ins) > 1 and len(ins[0].shape) == 2 \
            and len(ins[1].shape) == 3:
        e = ins[1].shape[0]
        return (attrs or {}).get("experts_loaded", min(e, ins[0].shape[0])) / e if e else 1.0
    return 1.0


def nxd_moe(rows: int, experts: int, tokens: int, decode: bool) -> tuple[int, int]:
    """(rows an expert GEMM computes, expert weights it loads) when NxD serves an MoE layer whose `tokens` tokens
    are routed to `rows` (token, expert) pairs over `experts` experts on this core (S49: ExpertMLPsV2.forward,
    inference, full capacity, the default of NxD Inference and optimum-neuron):
    - rows < experts: selective loading, each token through its own top-k experts, loaded per token;
    - else a decode step, or a context pass of fewer routed rows than a block: every token through every expert;
    - else blockwise: each expert's rows padded to blocks of NXD_MOE_BLOCK, as many blocks as the worst routing
      needs (one expert takes all but one row of each other's: ceil((rows - (E - 1)) / B) + E - 1, at most rows),
      every block computed and its expert's weights loaded for it."""
    if rows < experts:
        return rows, rows
    if decode or rows < NXD_MOE_BLOCK:
        return tokens * experts, experts
    blocks = min(math.ceil((rows - (experts - 1)) / NXD_MOE_BLOCK) + experts - 1, rows)
    return blocks * NXD_MOE_BLOCK, blocks


def _matmul(op, ins, outs, attrs, shard, t):
    ia, ib = op_info(op).operands
    a, b = ins[ia].shape, ins[ib].shape
    if op == "linear":  # weight is [N, K]
        b = (*b[:-2], b[-1], b[-2]) if len(b) >= 2 else b
    dims = {"b": max(math.prod(a[:-2]), math.prod(b[:-2])), "m": a[-2] if len(a) > 1 else 1,
            "k": a[-1], "n": b[-1] if len(b) > 1 else 1}
    bat = {"a": len(a) > 2, "b": len(b) > 2, "c": True}
    if op == "_grouped_mm" and len(a) == 2 and len(b) == 3:
        # MoE: the [M, K] rows are grouped by expert (offsets) against [E, K, N]: each row meets one expert, so
        # the work is one [M, K] x [K, N] GEMM (published grouped GEMMs run at their dense GEMMs' rate, G13); only
        # the experts hit are read (input_share)
        dims["b"], bat = 1, {"a": False, "b": False, "c": False}
        weights = b[0] * input_share(op, ins, ib, attrs)
    else:
        weights = 1
    if shard:
        dims[shard[0]] = math.ceil(dims[shard[0]] / shard[1])
    dclass = _mixed_class(ins[ia], ins[ib])
    size = {x: math.prod(dims[d] for d in _DIMS[x] if d != "b" or bat[x]) for x in "abc"}
    io = size["a"] * ins[ia].itemsize + weights * size["b"] * ins[ib].itemsize + size["c"] * outs[0].itemsize
    b, m, k, n = dims["b"], dims["m"], dims["k"], dims["n"]
    nbytes = max(io, _reread_bytes(b, m, k, n, ins[ia].itemsize, t))
    return Work(2 * b * m * k * n, _gemm_s(b, m, k, n, t, dclass), io, nbytes, t.matmul_flops(dclass))


def _conv_gemm(ins, outs, attrs):
    """Implicit-GEMM view of a convolution: (groups, M, K, N)."""
    x, w, y = ins[0].shape, ins[1].shape, outs[0].shape
    g, spatial = attrs.get("groups", 1), math.prod(w[2:])
    if attrs.get("transposed"):  # weight [Cin, Cout/g, *k]
        return g, x[0] * math.prod(x[2:]), w[0] // g, w[1] * spatial
    return g, y[0] * math.prod(y[2:]), w[1] * spatial, w[0] // g


def _conv(op, ins, outs, attrs, shard, t):
    if op == "convolution_backward":  # (grad_out, input, weight): grads of input and weight, each one GEMM
        ins, outs = ins[1:], ins[:1]
    g, m, k, n = _conv_gemm(ins, outs, attrs)
    gemms = sum(attrs.get("output_mask", (True, True))[:2]) if op == "convolution_backward" else 1
    if shard:  # tensor parallel splits the output channels
        n = math.ceil(n / shard[1])
    dclass = dtype_class(ins[0].dtype)
    io = sum(x.nbytes for x in (*ins, *outs))
    return Work(gemms * 2 * g * m * k * n, gemms * _gemm_s(g, m, k, n, t, dclass), io, io, t.matmul_flops(dclass))


_ATTN_BWD_GEMMS = 2.5  # backward: recompute QK^T, then dV, dP, dQ, dK: 5 GEMMs against the forward's 2


def _attention(op, ins, outs, attrs, shard, t):
    """Fused (flash) attention: the score matrix never leaves the chip. TensorE runs the two GEMMs per head,
    ScalarE the exponentials, VectorE the running max / sum; they overlap, the busiest one bounds."""
    bwd = op.endswith("backward")
    q, k, v = (ins[1:4] if bwd else ins[:3])
    bsz, h, sq, d = q.shape[0], q.shape[1], q.shape[-2], q.shape[-1]
    sk, dv = k.shape[-2], v.shape[-1]
    hk = k.shape[1]
    if shard:
        h, hk = math.ceil(h / shard[1]), math.ceil(hk / shard[1])
    frac = 1 - sq / (2 * sk) if attrs.get("is_causal") and sq <= sk else 1.0
    dclass = dtype_class(q.dtype)
    flops = 2 * bsz * h * sq * sk * (d + dv) * frac
    if t.is_neuron:
        gemm = (_gemm_s(bsz * h, sq, d, sk, t, dclass) + _gemm_s(bsz * h, sq, sk, dv, t, dclass)) * frac
    else:  # a GPU's flash kernel at its measured fraction of the peak (G4), scaled for fp8 by the peaks' ratio
        gemm = flops / (t.spec.peak_flops[dclass] * t.spec.attention_fraction(sk))
    scores = bsz * h * sq * sk * frac
    scalar = scores / t.engine_rate("scalar", q.itemsize)
    vector = (3 if bwd else 1) * scores / t.engine_rate("vector", q.itemsize)
    mult = _ATTN_BWD_GEMMS if bwd else 1
    qo = bsz * h * sq * (d + dv) * q.itemsize * (3 if bwd else 1)  # q, o (and dO, dQ, dO.o terms backward)
    kv = bsz * hk * sk * (d + dv) * k.itemsize * (2 if bwd else 1)  # k, v (and dK, dV)
    return Work(flops * mult, max(gemm * mult, scalar, vector), qo + kv, qo + kv, t.matmul_flops(dclass))


def _rnn(op, ins, outs, attrs, shard, t):
    """A recurrent layer over its whole sequence (input [T, B, I], weights [G*H, I] and [G*H, H]): each step one
    GEMM of [B, I + H] by [I + H, G*H] on TensorE, then the gates' activations (ScalarE) and products (VectorE),
    which the next step waits for. The backward runs two GEMMs per step (input and weight gradients)."""
    (steps, batch, _), w_ih, w_hh = ins[0].shape, ins[1].shape, ins[2].shape
    gates, k = w_ih[0], w_ih[1] + w_hh[1]
    if shard:
        gates = math.ceil(gates / shard[1])
    dclass, size = dtype_class(ins[0].dtype), ins[0].itemsize
    gemms = 2 if op.endswith("backward") else 1
    step = gemms * _gemm_s(1, batch, k, gates, t, dclass) + batch * gates * (
        1 / t.engine_rate("scalar", size) + 3 / t.engine_rate("vector", size))
    io = sum(x.nbytes for x in (*ins, *outs))
    return Work(gemms * 2 * steps * batch * k * gates, steps * step, io, io, t.matmul_flops(dclass))


# ---------------------------------------------------------------------------------------------- other engines

def _sweep(op, ins, outs, attrs, shard, t):
    """`passes` sweeps of the engine's datapath over the largest tensor (the op table's, else one per tensor input:
    S12, one input ~N cycles, two inputs ~2N; sorts and scans log2 of the last dim), plus the instruction cost."""
    info = op_info(op)
    engine = datapath(info.engine)
    tensors = [*ins, *outs]
    big = max(tensors, key=lambda x: x.numel, default=T((0,)))
    elems = big.numel / (shard[1] if shard else 1)
    io = sum(x.nbytes for x in tensors) / (shard[1] if shard else 1)
    if info.rule is Rule.SORT:
        passes = max(1.0, math.log2(max(ins[0].shape[-1:] or (1,))))
    else:
        passes = info.passes or max(1, len(ins))
    chunk = 128 * 2048  # elements per instruction: 128 partitions x a 2048-element free-axis tile
    if t.is_neuron:
        overhead = math.ceil(elems / chunk) * passes * t.spec.instr_cycles / getattr(t.spec, engine).clock_hz
    else:
        overhead = 0.0
    busy = elems * passes / t.engine_rate(engine, big.itemsize) + overhead
    return Work(elems * passes, busy, io, io)


def _copy(op, ins, outs, attrs, shard, t):
    """DMA: bandwidth-bound, no engine time."""
    io = sum(x.nbytes for x in (*ins, *outs)) / (shard[1] if shard else 1)
    return Work(0.0, 0.0, io, io)


def _gather(op, ins, outs, attrs, shard, t):
    """A lookup touches only the rows it returns, not the whole table: its output, read and written."""
    ways = shard[1] if shard else 1
    elems = sum(o.numel for o in outs[:1]) / ways
    io = (2 * sum(o.nbytes for o in outs[:1]) + sum(x.nbytes for x in ins if x.itemsize == 8)) / ways
    return Work(elems, _indexing_s(op, elems, outs[0].itemsize, t), io, io)


def _scatter(op, ins, outs, attrs, shard, t):
    """An update in place (a cache write) touches only the rows it writes: its updates, read and written."""
    ways = shard[1] if shard else 1
    upd = [x for x in ins[1:] if x.itemsize != 8] or ins[:1]
    elems = max(x.numel for x in upd) / ways
    io = (2 * sum(x.nbytes for x in upd) + sum(x.nbytes for x in ins if x.itemsize == 8)) / ways
    return Work(elems, _indexing_s(op, elems, upd[0].itemsize, t), io, io)


def _indexing_s(op: str, elems: float, itemsize: int, t: Target) -> float:
    """Engine time of an indexed access: GpSimd walks the indices (a host fallback is priced there too); on DMA
    (contiguous slices) only the traffic counts."""
    engine = op_info(op).engine
    return 0.0 if engine == "dma" else elems / t.engine_rate("gpsimd" if engine == "host" else engine, itemsize)


def _free(op, ins, outs, attrs, shard, t):
    return Work(0.0, 0.0, 0.0, 0.0)


# The implementation of each cost rule of the op table.
RULES: dict[Rule, Callable[..., Work]] = {
    Rule.MATMUL: _matmul, Rule.CONV: _conv, Rule.ATTENTION: _attention, Rule.RNN: _rnn, Rule.SWEEP: _sweep,
    Rule.SORT: _sweep, Rule.GATHER: _gather, Rule.SCATTER: _scatter, Rule.COPY: _copy, Rule.FREE: _free,
}

MODES = ("eager", "kernel", "fused")


def op_cost(op: str, inputs: Sequence[T], outputs: Sequence[T], tgt: Target | str = "trn2", *,
            attrs: Mapping | None = None, shard: tuple[str, int] | None = None,
            mode: str = "eager") -> OpCost:
    """The cost of `op` (an ATen name, e.g. "aten::mm" or "mm") on one core of `tgt`.

    `attrs` are the op's non-tensor arguments by schema name (groups, is_causal, ...). `shard=(dim, ways)`
    costs this core's share of a tensor-parallel op: for matmuls dim is "b", "m", "k" or "n", for attention
    "heads", otherwise "all" (elements). `mode`: "eager" (its own launched kernel), "kernel" (its own kernel
    in a compiled graph), or "fused" (inside a larger kernel: no fixed cost; see kernel_time)."""
    t, name, info = target(tgt), base_name(op), op_info(op)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    ins, outs = [T(*x) for x in inputs], [T(*x) for x in outputs]
    if info.rule is Rule.FREE:
        return OpCost(name, info.engine, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, t.hbm_bw)
    w = RULES[info.rule](name, ins, outs, dict(attrs or {}), shard, t)
    overhead = {"eager": t.launch_s + t.kernel_s, "kernel": t.kernel_s, "fused": 0.0}[mode]
    return OpCost(name, info.engine, w.flops, w.bytes, w.io_bytes, w.compute_s, w.bytes / t.hbm_bw, overhead,
                  w.peak_flops, t.hbm_bw)


def kernel_time(costs: Sequence[OpCost], hbm_bytes: float, tgt: Target | str, *,
                eager: bool = False) -> float:
    """A kernel of fused ops: its engines run concurrently, so it takes its busiest engine's summed time or
    its HBM traffic (external inputs, outputs used outside, spilled intermediates), whichever is longer, plus
    the fixed cost of a kernel (and of a launch when run eagerly)."""
    t = target(tgt)
    busy: dict[str, float] = defaultdict(float)
    for c in costs:
        busy[datapath(c.engine)] += c.compute_s
    fixed = t.kernel_s + (t.launch_s if eager else 0.0)
    return max(max(busy.values(), default=0.0), hbm_bytes / t.hbm_bw) + fixed


# ---------------------------------------------------------------------------------------------- collectives

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _steps(kind: str, n: int, nbytes: float) -> int:
    """Algorithm steps, with the algorithm AWS picks by message size (S41): Mesh below 1 MiB (O(1)), recursive
    doubling-halving up to 56 MiB (O(log n)), ring above (O(n)). All-reduce = reduce-scatter + all-gather."""
    if n <= 1:
        return 0
    one = 1 if nbytes < 1 << 20 else math.ceil(math.log2(n)) if nbytes <= 56 << 20 else n - 1
    return 2 * one if kind == "all_reduce" else one


def _traffic(kind: str, n: int) -> float:
    """Bytes each rank sends per byte of the full buffer (bandwidth-optimal algorithms; all-to-all: the buffer is
    the rank's own send buffer, of which 1/n stays home)."""
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n


def collective_cost(kind: str, nbytes: float, ranks: int, tgt: Target | str, *,
                    ranks_per_node: int | None = None, efa_bw: float = 0.0) -> OpCost:
    """A collective over `ranks` logical cores on buffer `nbytes` (all-reduce: the buffer; all-gather: the
    gathered output; reduce-scatter: the input). Hierarchical (S42): an intra-instance stage over
    `ranks_per_node` ranks at the fabric's bus bandwidth, and an inter-instance stage over EFA at `efa_bw`
    bytes/s per rank on the 1/ranks_per_node share of the buffer. Time = fixed latency + steps x hop latency +
    traffic / bandwidth."""
    if kind not in COLLECTIVES:
        raise ValueError(f"kind must be one of {COLLECTIVES}")
    t = target(tgt)
    per_node = min(ranks, ranks_per_node or ranks)
    nodes = math.ceil(ranks / per_node)
    f = t.spec.fabric
    time = f.fixed_s if ranks > 1 else 0.0
    if kind == "all_to_all":  # nothing to reduce or combine: each block goes straight to its rank
        return _all_to_all(nbytes, ranks, per_node, nodes, t, efa_bw, time)
    if per_node > 1:
        time += _steps(kind, per_node, nbytes) * f.hop_s + _traffic(kind, per_node) * nbytes / t.busbw
    if nodes > 1:
        if not efa_bw:
            raise ValueError("a collective across instances needs the EFA bandwidth per rank")
        share = nbytes / per_node
        time += _steps(kind, nodes, share) * f.efa_hop_s + _traffic(kind, nodes) * share / efa_bw
    moved = _traffic(kind, ranks) * nbytes
    return OpCost(kind, "collective", 0.0, moved, moved, time, 0.0, 0.0, 0.0, t.busbw)


def _all_to_all(nbytes: float, ranks: int, per_node: int, nodes: int, t: Target, efa_bw: float,
                time: float) -> OpCost:
    """An all-to-all (MoE dispatch or combine): each rank sends 1/ranks of its `nbytes` send buffer to every other
    rank, the blocks for ranks in its own instance over the fabric, the others over EFA, one exchange step per
    destination group (Mesh, as the algorithm for small messages: S41). Not hierarchical: there is nothing to
    combine before leaving the instance."""
    f = t.spec.fabric
    local = (per_node - 1) / ranks * nbytes
    remote = (ranks - per_node) / ranks * nbytes
    if per_node > 1:
        time += f.hop_s + local / t.busbw
    if nodes > 1:
        if not efa_bw:
            raise ValueError("a collective across instances needs the EFA bandwidth per rank")
        time += f.efa_hop_s + remote / efa_bw
    moved = local + remote
    return OpCost("all_to_all", "collective", 0.0, moved, moved, time, 0.0, 0.0, 0.0, t.busbw)
