"""`nki.isa` (imported as `nisa`): the NeuronCore instructions, each checked against the hardware's rules,
computed as the engine computes it (float32 inside, the result rounded to the destination's dtype), and placed
on the kernel's per-engine timeline.

Both forms of AWS's API are accepted: the current one, where the destination comes first (`dst=`), and the
earlier one, where the instruction returns a new tile (`nisa.nc_matmul(stationary, moving)`)."""
from __future__ import annotations

import enum
import math
from typing import Any

import numpy as np
import torch

from . import core
from .core import PMAX, PSUM, PSUM_FREE_MAX, SBUF, SBUF_FREE_MAX, NkiTensor, fail
from .cost import engine_cycles, matmul_cycles, row_bytes
from .ops import ALU_UNARY, OPS, Op, as_op

# A package path, so `nki.isa.constants` (served by NkiAlias as this module) imports as a submodule.
__path__: list[str] = []


class engine(enum.Enum):  # noqa: N801 (AWS's name)
    unknown = "unknown"
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    activation = "scalar"
    sync = "sync"


# the earlier names of the engines
tensor_engine, vector_engine, scalar_engine, gpsimd_engine = engine.tensor, engine.vector, engine.scalar, engine.gpsimd
unknown_engine = engine.unknown


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class nc_version(enum.IntEnum):  # noqa: N801
    gen2 = 2
    gen3 = 3
    gen4 = 4


_VERSION = {"NeuronCore-v2": nc_version.gen2, "NeuronCore-v3": nc_version.gen3, "NeuronCore-v4": nc_version.gen4}


def get_nc_version() -> nc_version:
    return _VERSION[core.current_run().chip.core_version]


# Which buffers each engine reads and writes (S12): TensorE reads SBUF and writes PSUM; Vector and Scalar read and
# write both; GpSimd cannot reach PSUM; only DMA reaches HBM (and never PSUM).
ACCESS = {
    "tensor": ({"sbuf"}, {"psum"}),
    "vector": ({"sbuf", "psum"}, {"sbuf", "psum"}),
    "scalar": ({"sbuf", "psum"}, {"sbuf", "psum"}),
    "gpsimd": ({"sbuf"}, {"sbuf"}),
    "dma": ({"hbm", "shared_hbm", "private_hbm", "sbuf"}, {"hbm", "shared_hbm", "private_hbm", "sbuf"}),
}
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


# --------------------------------------------------------------------------------------------- checks
def _engine_name(e: Any, default: str) -> str:
    if isinstance(e, engine):
        e = e.value
    return default if e in (None, "unknown") else e


def _check_tile(t: NkiTensor, instr: str, role: str, free_max: int | None = None) -> None:
    """An on-chip operand of a compute instruction: partition axis first, <= 128 partitions, aligned start."""
    if t.pdim != 0:
        fail(ValueError, f"{instr}: {role} still has {t.pdim} block axes before its partition axis: index them")
    start, n = t.partitions
    if n > PMAX:
        fail(ValueError, f"{instr}: {role} spans {n} partitions, more than {PMAX}")
    ok = start == 0 if n > 64 else (start in (0, 64) if n > 32 else start % 32 == 0)
    if not ok:
        fail(ValueError, f"{instr}: {role} covers partitions {start}..{start + n - 1}; an access of {n} partitions "
                         "must start at partition 0 (more than 64), 0 or 64 (33-64), or a multiple of 32 (1-32)")
    limit = free_max or (PSUM_FREE_MAX if t.buffer is PSUM else SBUF_FREE_MAX)
    if t.free_size > limit:
        fail(ValueError, f"{instr}: {role} has {t.free_size} elements per partition; an engine reads at most "
                         f"{limit} from {t.buffer.name}")


def _check_access(eng: str, instr: str, reads: list, writes: list) -> None:
    can_read, can_write = ACCESS[eng]
    for role, t, allowed, verb in [*((r, t, can_read, "read") for r, t in reads),
                                   *((r, t, can_write, "write") for r, t in writes)]:
        if not isinstance(t, NkiTensor):
            fail(TypeError, f"{instr}: {role} must be a tile (an nl.ndarray or a slice of one), got {type(t).__name__}")
        if t.buffer.name not in allowed:
            fail(ValueError, f"{instr}: the {eng} engine cannot {verb} {t.buffer.name} ({role}); it can {verb} "
                             f"{', '.join(sorted(allowed))}")
        if eng != "dma" and t.buffer.on_chip:
            _check_tile(t, instr, role)
        if isinstance(t, core.GatherTile) and t.indirect and eng != "dma":
            fail(ValueError, f"{instr}: {role} is addressed by a tile of indices; only DMA reads and writes through "
                             "computed indices (load it with nl.load / nisa.dma_copy first)")
        if isinstance(t, core.GatherTile) and t.valid is not None:
            m = core.mask_for(t)
            outside = ~t.valid if m is None else ~t.valid & m
            if bool(outside.any()):
                fail(IndexError, f"{instr}: {role} reaches {int(outside.sum())} elements outside its {t.src.shape} "
                                 f"tensor ({t.buffer.name}) that the instruction's mask= does not exclude")


def _init_view(t: NkiTensor) -> np.ndarray | None:
    init = t.alloc.init
    if init is None:
        return None
    if isinstance(t, core.GatherTile):
        return _init_view(t.src)[tuple(i.numpy() for i in t.idx)]  # a copy: for reading only
    flat = init.reshape(-1)[t.data.storage_offset():]
    return np.lib.stride_tricks.as_strided(flat, tuple(t.data.shape), tuple(t.data.stride()))


# Instructions whose outputs mix partitions: an uninitialised input element reaches every output element.
_CROSS_PARTITION = ("nc_matmul", "nc_transpose", "dma_transpose", "tensor_partition_reduce")
# The current instruction's outputs computed from uninitialised inputs: (write tile, its elements) for
# _mark_written, which leaves them uninitialised.
_POISONED: list[tuple[NkiTensor, torch.Tensor]] = []


def _check_initialised(instr: str, reads: list, writes: list = ()) -> None:
    """Reading memory no instruction wrote is what hardware allows (it reads whatever the memory held): the
    outputs computed from it stay uninitialised (elementwise, per partition, or the whole output when the
    instruction mixes partitions), and storing such elements to HBM warns and writes NaN there."""
    _POISONED.clear()
    for _, t in reads:
        v = _init_view(t)
        if v is not None:
            m = core.mask_for(t)
            if isinstance(t, core.GatherTile) and t.valid is not None:
                m = t.valid if m is None else m & t.valid
            bad = ~v if m is None else ~v & m.numpy()
            if bool(bad.any()):
                _poison(instr, t, torch.from_numpy(np.ascontiguousarray(bad)), writes)
        if t.buffer is PSUM:
            t.alloc.mm_read = True


def _poison(instr: str, t: NkiTensor, bad: torch.Tensor, writes: list) -> None:
    p = t.shape[0] if t.shape else 1
    rows = bad.reshape(p, -1)
    run = core.current_run()
    if not run.garbage_from:
        run.garbage_from = core.where().removeprefix(f"NKI kernel {run.kernel_name!r}, ")
    for _, w in writes:
        shape = w.shape or (1,)
        free = math.prod(shape[1:])
        if instr.split("(")[0] in _CROSS_PARTITION or shape[0] != p:
            e = torch.ones(shape, dtype=torch.bool)  # mixed across partitions: every output element
        else:
            e = (rows if rows.shape[1] == free else rows.any(1, keepdim=True).expand(p, free)).reshape(shape)
        _POISONED.append((w, e))


def _garbage_to_hbm(t: NkiTensor, bad: torch.Tensor) -> None:
    """Elements computed from uninitialised memory stored to HBM: NaN there (the hardware stores whatever the
    memory held), and a warning naming the store and where the garbage was first computed on."""
    import warnings

    run = core.current_run()
    if run.compute and t.dtype.is_floating_point:
        if isinstance(t, core.GatherTile):
            idx = t.selected(bad)
            t.src.data[tuple(i for i in (t.idx if idx is None else idx))] = float("nan")
        else:
            t.data[bad] = float("nan")
    warnings.warn(f"{core.where()}: {int(bad.sum())} of {bad.numel()} elements stored to HBM were computed from "
                  f"uninitialised memory (since {run.garbage_from}); on hardware they are whatever the memory held, "
                  "here NaN", RuntimeWarning, stacklevel=2)


def _mark_written(writes: list) -> None:
    for _, t in writes:
        m = core.mask_for(t)
        if isinstance(t, core.GatherTile):
            if t.alloc.init is not None:
                init = _init_view(t.src)
                idx = t.selected(m)
                init[tuple(i.numpy() for i in (t.idx if idx is None else idx))] = True
                for w, bad in _POISONED:
                    if w is t:
                        idx = t.selected(bad if m is None else bad & m)
                        init[tuple(i.numpy() for i in (t.idx if idx is None else idx))] = False
            else:
                for w, bad in _POISONED:
                    if w is t and bool((bad := bad if m is None else bad & m).any()):
                        _garbage_to_hbm(t, bad)
            continue
        v = _init_view(t)
        for w, bad in _POISONED:
            if w is t:
                bad = bad if m is None else bad & m
                if v is None and bool(bad.any()):
                    _garbage_to_hbm(t, bad)
        if v is not None:
            v[... if m is None else m.numpy()] = True
            for w, bad in _POISONED:
                if w is t:
                    v[(bad if m is None else bad & m).numpy()] = False
        if t.buffer is PSUM:
            t.alloc.mm_read = False
    _POISONED.clear()
    if _OUTER_MASK:
        core.CURRENT.mask = _OUTER_MASK.pop()


# CURRENT.mask before operand masks (`tile[predicate]`) of the instruction being issued took effect; restored
# by _mark_written, the last step of every instruction.
_OUTER_MASK: list[torch.Tensor | None] = []


def _operand_masks(tiles: list, extra: list = ()) -> None:
    masks = [t.pmask for t in tiles if isinstance(t, NkiTensor) and t.pmask is not None] + list(extra)
    if masks:
        _OUTER_MASK.append(core.CURRENT.mask)
        for m in masks:
            core.CURRENT.mask = m if core.CURRENT.mask is None else core.CURRENT.mask & m


def _issue(instr: str, eng: str, cycles: float, reads: list, writes: list, flops: int = 0) -> core.Run:
    run = core.current_run()
    _operand_masks([t for _, t in reads + writes])
    _check_access(eng, instr, reads, writes)
    _check_initialised(instr, reads, writes)
    if not core.masked_off():  # mask=False: the compiler drops the instruction
        line = core._user_frame()[1]
        run.timeline.compute(instr, eng, cycles, [t for _, t in reads], [t for _, t in writes], line, flops)
    return run


# --------------------------------------------------------------------------------------------- values
def value(t: Any) -> torch.Tensor:
    """An operand as the engines see it: float32 (integers stay integers for bit operations)."""
    if isinstance(t, NkiTensor):
        d = t.data
        if d.dtype in (torch.uint16, torch.uint32):  # torch computes little on these: widen (values unchanged)
            return d.long()
        return d if not d.is_floating_point() and d.dtype != torch.bool else d.float()
    return torch.tensor(t, dtype=torch.float32)


def _rows(t: NkiTensor) -> torch.Tensor:
    """A tile's values as [partitions, elements per partition]."""
    return value(t).reshape(t.shape[0], -1)


def _vector(x: Any, p: int, instr: str, role: str) -> Any:
    """A scalar, or a [P, 1] tile broadcast along the free axis."""
    if isinstance(x, NkiTensor):
        if x.shape[0] != p or x.free_size != 1:
            fail(ValueError, f"{instr}: {role} must be a scalar or a [{p}, 1] tile, got shape {x.shape}")
        return value(x).reshape(p, 1)
    return x


def round_to(x: torch.Tensor, dtype: torch.dtype, stochastic: bool = False,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 results into `dtype`: round to nearest even (the engines' default), or stochastically: up with
    probability equal to the distance from the value below, in units of the gap between the two."""
    if not dtype.is_floating_point or dtype == torch.float32:
        if not dtype.is_floating_point and x.is_floating_point():
            x = torch.round(x)
        return x.to(dtype)
    near = x.to(dtype)
    if not stochastic:
        return near
    back = near.float()
    ibits = {1: torch.int8, 2: torch.int16}[dtype.itemsize]
    bits = near.view(ibits)
    step = torch.where(back.abs() > x.abs(), -1, 1).to(ibits)
    other = (bits + step).view(dtype).float()
    gap = (other - back).abs()
    p = torch.where(gap > 0, (x - back).abs() / gap, torch.zeros_like(gap))
    u = torch.rand(x.shape, generator=generator)
    pick = (u < p) & torch.isfinite(other) & (back != x)
    return torch.where(pick, other, back).to(dtype)


def _store(run: core.Run, dst: NkiTensor, v: torch.Tensor) -> None:
    if not run.compute:
        return
    v = v.reshape(dst.shape) if v.numel() == dst.data.numel() else v.expand(dst.shape)
    v = round_to(v, dst.dtype, run.stochastic_rounding, run.generator)
    m = core.mask_for(dst)
    if isinstance(dst, core.GatherTile):
        dst.write(v, m)
        return
    out = dst.data
    if m is not None:  # only the mask's elements are written
        v = torch.where(m, v, out)
    for axis, (stride, n) in enumerate(zip(out.stride(), out.shape, strict=True)):
        if stride == 0 and n > 1:  # a step-0 access pattern writes one place repeatedly: the last write stays
            out, v = out.narrow(axis, n - 1, 1), v.narrow(axis, n - 1, 1)
    out.copy_(v)


_new = core.result_tile  # a legacy form's result tile


def assign_result(dst: NkiTensor, src: NkiTensor) -> bool:
    """`dst[...] = instr(...)` right after the call: AWS's compiler places the instruction's output in dst, so the
    instruction that made `src` (a call's result tile, the last instruction issued) writes dst instead: no copy
    on the timeline, dst held to that instruction's engine rules (a DMA writes any partition). False when it
    cannot (another instruction came between, the engine cannot write dst's memory or place, a reshaping or
    narrowing assignment): the caller copies."""
    run = core.current_run()
    if type(src) is not NkiTensor or not src.alloc.result or src.shape != dst.shape or src.alloc is dst.alloc \
            or dst.pmask is not None:  # (`t[pred] = ...`: the copy applies the predicate)
        return False
    eng = run.timeline.held_engine(src)
    if eng is None or (src.dtype != dst.dtype and eng != "dma" and src.dtype != torch.float32):
        return False  # (a narrow result widened would be rounded twice)
    try:
        _check_access(eng, "assign", [], [("dst", dst)])
    except (ValueError, TypeError, IndexError):
        return False
    run.timeline.retarget(src, dst)
    _check_initialised("assign", [("src", src)], [("dst", dst)])
    if run.compute:
        _store(run, dst, value(src))
    _mark_written([("dst", dst)])
    return True


def _tiles(args: tuple) -> int:
    return sum(isinstance(a, NkiTensor) for a in args)


# --------------------------------------------------------------------------------------------- TensorE
class matmul_perf_mode(enum.Enum):  # noqa: N801 (AWS's name)
    none = "none"
    double_row = "double_row"


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _double_row(perf_mode: Any) -> bool:
    """Whether perf_mode asks for the FP8 double-row mode (`matmul_perf_mode.double_row`, or the earlier string
    names `"double_row"`, `"double_row_gen3"`)."""
    name = perf_mode.value if isinstance(perf_mode, matmul_perf_mode) else str(perf_mode or "none")
    return name.startswith("double_row")


def nc_matmul(*args: Any, dst: NkiTensor | None = None, stationary: NkiTensor | None = None,
              moving: NkiTensor | None = None, is_stationary_onezero: bool = False, is_moving_onezero: bool = False,
              is_transpose: bool = False, accumulate: bool | None = None, perf_mode: Any = None,
              **_: Any) -> NkiTensor | None:
    """dst[M, N] (PSUM, float32) = stationary[K, M].T @ moving[K, N] on the Tensor engine; K <= 128 partitions,
    M <= 128, N <= 512 (one PSUM bank). Into an initialised PSUM tile not read since the last matmul the product
    accumulates (accumulate=None), as consecutive matmuls into one bank do."""
    legacy = dst is None and len(args) < 3
    if legacy:
        stationary, moving = (list(args) + [stationary, moving])[:2] if args else (stationary, moving)
    else:
        names = ["dst", "stationary", "moving"]
        given = dict(zip(names, args, strict=False))
        dst, stationary = given.get("dst", dst), given.get("stationary", stationary)
        moving = given.get("moving", moving)
    run = core.current_run()
    for role, t in (("stationary", stationary), ("moving", moving)):
        if not isinstance(t, NkiTensor):
            fail(TypeError, f"nc_matmul: {role} must be a tile")
        if t.dtype not in MATMUL_DTYPES:
            fail(TypeError, f"nc_matmul: {role} has dtype {t.dtype}; the Tensor engine multiplies float8/bfloat16/"
                            "float16/float32")
    if legacy:  # the compiler moves a PSUM operand (an earlier nc_transpose's result) to SBUF first
        stationary, moving = _to_sbuf(stationary), _to_sbuf(moving)
    double = _double_row(perf_mode)
    if double:  # FP8 double-row mode: [K, 2, M] x [K, 2, N], the two rows of each pair contracted together
        if core.current_run().chip.core_version == "NeuronCore-v2":
            fail(ValueError, "nc_matmul: perf_mode double_row needs NeuronCore-v3 or newer (trn2, trn3); "
                             "NeuronCore-v2 has no performance modes")
        for role, t in (("stationary", stationary), ("moving", moving)):
            if t.dtype not in _FP8:
                fail(TypeError, f"nc_matmul: perf_mode double_row multiplies fp8 pairs; {role} is {t.dtype}")
            if t.ndim != 3 or t.shape[1] != 2:
                fail(ValueError, f"nc_matmul: perf_mode double_row takes [K, 2, free] operands; {role} is "
                                 f"{t.shape}")
    k, m = stationary.shape[0], stationary.free_size // (2 if double else 1)
    k2, n = moving.shape[0], moving.free_size // (2 if double else 1)
    if k != k2:
        fail(ValueError, f"nc_matmul: stationary and moving must share the partition (contraction) size, got "
                         f"{k} and {k2}")
    if m > 128:
        fail(ValueError, f"nc_matmul: stationary free size {m} exceeds 128 (nl.tile_size.gemm_stationary_fmax)")
    if n > 512:
        fail(ValueError, f"nc_matmul: moving free size {n} exceeds 512 (nl.tile_size.gemm_moving_fmax)")
    if legacy:
        dst = _new((m, n), torch.float32, PSUM)
        dst.alloc.matmul_result = True
    if dst.shape[0] != m or dst.free_size != n:
        fail(ValueError, f"nc_matmul: dst must be [{m}, {n}] (stationary free x moving free), got {dst.shape}")
    if dst.dtype not in (torch.float32, torch.bfloat16):
        fail(TypeError, f"nc_matmul: a PSUM result is float32 (or bfloat16), got {dst.dtype}")
    init = _init_view(dst)
    acc = accumulate if accumulate is not None else (init is not None and bool(init.all())
                                                      and not dst.alloc.mm_read)
    reads = [("stationary", stationary), ("moving", moving)] + ([("dst", dst)] if acc and accumulate else [])
    fp32 = torch.float32 in (stationary.dtype, moving.dtype) and not (is_stationary_onezero or is_moving_onezero)
    _issue("nc_matmul", "tensor", matmul_cycles(run.chip, n, fp32), reads, [("dst", dst)],
           flops=2 * k * m * n * (2 if double else 1))  # double_row: twice the work in the same cycles
    if run.compute:
        if double:  # contract K and the row pair: [2K, M].T @ [2K, N]
            prod = value(stationary).permute(1, 0, 2).reshape(2 * k, m).T @ \
                value(moving).permute(1, 0, 2).reshape(2 * k, n)
        else:
            prod = _rows(stationary).T @ _rows(moving)
        if is_transpose:
            prod = _rows(stationary).T
        if acc:
            prod = prod + value(dst).reshape(m, n)
        _store(run, dst, prod)
    _mark_written([("dst", dst)])
    return dst if legacy else None


def _to_sbuf(t: NkiTensor) -> NkiTensor:
    """A PSUM tile copied to SBUF on the Vector engine (what the compiler inserts before an engine that cannot
    read PSUM, in the earlier API where it places the tiles); other tiles as they are."""
    if t.buffer is not PSUM:
        return t
    out = _new(t.shape, t.dtype)
    tensor_copy(dst=out, src=t)
    return out


def accumulate_psum(dst: NkiTensor, src: NkiTensor) -> None:
    """`psum += nisa.nc_matmul(...)` (legacy form): the product lands in dst, accumulating (no extra instruction)."""
    run = core.current_run()
    init = _init_view(dst)
    if run.compute:
        v = value(src).reshape(dst.shape)
        if init is not None and bool(init.all()) and not dst.alloc.mm_read:
            v = v + value(dst)
        _store(run, dst, v)
    _mark_written([("dst", dst)])


def nc_transpose(*args: Any, dst: NkiTensor | None = None, data: NkiTensor | None = None, engine: Any = None,
                 **_: Any) -> NkiTensor | None:
    """dst[F, P] = data[P, F]: on the Tensor engine (a matmul against the identity, SBUF -> PSUM, P and F <= 128)
    or the Vector engine (at most 32 x 32)."""
    legacy = dst is None and _tiles(args) < 2
    if legacy:
        data = args[0] if args else data
    else:
        dst, data = (list(args) + [dst, data])[:2] if len(args) >= 2 else (args[0] if args else dst, data)
    run = core.current_run()
    p, f = data.shape[0], data.free_size
    eng = _engine_name(engine, "tensor")
    if eng == "tensor" and f > 128:
        fail(ValueError, f"nc_transpose: the Tensor engine transposes at most 128 x 128, got [{p}, {f}]")
    if eng == "vector" and (p > 32 or f > 32):
        fail(ValueError, f"nc_transpose: the Vector engine transposes at most 32 x 32, got [{p}, {f}]")
    if legacy:
        dst = _new((f, p), data.dtype if eng == "vector" else torch.float32, PSUM if eng == "tensor" else SBUF)
    if dst.shape[0] != f or dst.free_size != p:
        fail(ValueError, f"nc_transpose: dst must be [{f}, {p}], got {dst.shape}")
    cycles = matmul_cycles(run.chip, p, data.dtype == torch.float32) if eng == "tensor" else \
        engine_cycles(run.chip, eng, p, data.dtype.itemsize)
    saved = core.CURRENT.mask
    _issue("nc_transpose", eng, cycles, [("data", data)], [("dst", dst)])
    m = core.mask_for(data)  # mask= (and operand predicates) name the input's [P, F] axes (AWS): dst is transposed
    mt = None if m is None else m.reshape(p, f).T.reshape(dst.shape)
    if mt is not None:
        core.CURRENT.mask = mt
        if legacy:  # what assigning the result copies (`t[...] = nc_transpose(x, mask=...)`)
            dst.alloc.mask = mt
    if run.compute:
        _store(run, dst, _rows(data).T)
    _mark_written([("dst", dst)])
    if mt is not None:
        core.CURRENT.mask = saved
    return dst if legacy else None


# --------------------------------------------------------------------------------------------- Scalar engine
def _act_fn(op: Any, instr: str) -> Op:
    op = as_op(op)
    if getattr(op, "__name__", "") == "copy":  # nl.copy, the function, names the identity activation too
        return OPS["copy"]
    if isinstance(op, Op) and (op.kind == "act" or op.name in ("exp", "copy")):
        return op
    fail(ValueError, f"{instr}: op must be an activation function (nl.exp, nl.tanh, nl.gelu, nl.copy, ...), "
                     f"got {op!r}")


def activation(*args: Any, dst: NkiTensor | None = None, op: Any = None, data: NkiTensor | None = None,
               bias: Any = None, scale: Any = 1.0, reduce_op: Any = None, reduce_res: NkiTensor | None = None,
               reduce_cmd: reduce_cmd = reduce_cmd.idle, dtype: Any = None, **_: Any) -> NkiTensor | None:
    """dst = op(data * scale + bias) on the Scalar engine; scale a scalar or a [P, 1] tile, bias a [P, 1] tile.
    With reduce_res (reduce_op nl.add) the free-axis sum of the result is also written ([P, 1])."""
    legacy = dst is None and (not args or isinstance(as_op(args[0]), Op))
    if legacy:
        op, data = (list(args) + [op, data])[:2] if len(args) >= 2 else (args[0] if args else op, data)
    else:
        names = ["dst", "op", "data", "bias", "scale"]
        given = dict(zip(names, args, strict=False))
        dst, op, data = given.get("dst", dst), given.get("op", op), given.get("data", data)
        bias, scale = given.get("bias", bias), given.get("scale", scale)
    fn = _act_fn(op, "activation")
    run = core.current_run()
    if legacy:
        dst = _new(data.shape, dtype or data.dtype)
    p = data.shape[0]
    if dst.shape[0] != p or dst.free_size != data.free_size:
        fail(ValueError, f"activation: dst {dst.shape} and data {data.shape} must have the same partition and free "
                         "sizes")
    reads = [("data", data)] + [(r, t) for r, t in (("bias", bias), ("scale", scale)) if isinstance(t, NkiTensor)]
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    if reduce_op is not None and getattr(as_op(reduce_op), "name", None) not in ("add", "sum"):
        fail(ValueError, "activation: the Scalar engine's reduction registers only sum (reduce_op=nl.add)")
    cycles = engine_cycles(run.chip, "scalar", data.free_size, data.dtype.itemsize)
    cycles += run.chip.mm_min_cycles if reduce_res is not None else 0
    _issue(f"activation({fn.name})", "scalar", cycles, reads, writes)
    if run.compute:
        x = _rows(data) * _vector(scale, p, "activation", "scale")
        if bias is not None:
            x = x + _vector(bias, p, "activation", "bias")
        # the values written, as the reduction sees them (a step-0 dst keeps only its last write in memory)
        y = fn.fn(x)
        y = y.reshape(dst.shape) if y.numel() == dst.data.numel() else y.expand(dst.shape)
        y = round_to(y, dst.dtype, run.stochastic_rounding, run.generator)
        _store(run, dst, y)
        cmd = reduce_cmd
        if reduce_res is not None and cmd == type(cmd).idle:
            cmd = type(cmd).reset_reduce  # reduce_res alone: this instruction's sum (activation_reduce)
        if cmd != type(cmd).idle:
            regs = run.act_regs
            if regs is None or cmd in (type(cmd).reset, type(cmd).reset_reduce):
                regs = torch.zeros(p, 1)
            if cmd != type(cmd).reset:
                m = core.mask_for(dst)
                y = y.float() if m is None else torch.where(m, y.float(), torch.tensor(0.0))
                regs = regs + y.reshape(p, -1).sum(1, keepdim=True)
            run.act_regs = regs
            if reduce_res is not None:
                _store(run, reduce_res, regs)
    _mark_written(writes)
    return dst if legacy else None


def activation_reduce(*args: Any, dst: NkiTensor | None = None, op: Any = None, data: NkiTensor | None = None,
                      reduce_op: Any = None, reduce_res: NkiTensor | None = None, bias: Any = None,
                      scale: Any = 1.0, dtype: Any = None, **_: Any) -> NkiTensor | None:
    """activation with the free-axis sum of its result written to reduce_res."""
    return activation(*args, dst=dst, op=op, data=data, bias=bias, scale=scale, reduce_op=reduce_op,
                      reduce_res=reduce_res, reduce_cmd=reduce_cmd.reset_reduce, dtype=dtype)


# --------------------------------------------------------------------------------------------- Vector engine
def _arith(op: Any, instr: str) -> Op:
    op = as_op(op)
    if isinstance(op, Op) and op.name in ALU_UNARY:  # |data|, rsqrt(data), ...: the operand unused
        return ALU_UNARY[op.name]
    if not isinstance(op, Op) or op.kind == "act":
        fail(ValueError, f"{instr}: op must be a binary or ALU unary operator (nl.add, nl.multiply, nl.rsqrt, ...), "
                         f"got {op!r}")
    if op.name in ("abs_max", "abs_min") and core.current_run().chip.core_version in ("NeuronCore-v2",
                                                                                       "NeuronCore-v3"):
        fail(ValueError, f"{instr}: nl.{op.name} needs NeuronCore-v4 or newer (trn3)")
    return op


def reset() -> None:
    """Forget the operand-mask state a failed instruction may have left (a new kernel call starts clean)."""
    _OUTER_MASK.clear()
    _POISONED.clear()
    core.CURRENT.mask = None


def _same_shape(dst: NkiTensor, data: NkiTensor, instr: str) -> None:
    if dst.shape[0] != data.shape[0] or dst.free_size != data.free_size:
        fail(ValueError, f"{instr}: dst {dst.shape} and input {data.shape} must have the same partition size and "
                         "elements per partition")


def tensor_tensor(*args: Any, dst: NkiTensor | None = None, data1: NkiTensor | None = None,
                  data2: NkiTensor | None = None, op: Any = None, engine: Any = None, dtype: Any = None,
                  **_: Any) -> NkiTensor | None:
    """dst = data1 <op> data2, elementwise, on the Vector engine (GpSimd for nl.power); the inputs may not both be
    in PSUM."""
    legacy = dst is None and _tiles(args) < 3
    names = ["data1", "data2", "op"] if legacy else ["dst", "data1", "data2", "op"]
    given = dict(zip(names, args, strict=False))
    dst, data1, data2, op = given.get("dst", dst), given.get("data1", data1), given.get("data2", data2), \
        given.get("op", op)
    op = _arith(op, "tensor_tensor")
    run = core.current_run()
    eng = _engine_name(engine, "gpsimd" if op.name == "power" else "vector")
    if legacy and data1.shape != data2.shape and data1.ndim == data2.ndim and all(
            a == b or 1 in (a, b) for a, b in zip(data1.shape, data2.shape, strict=True)):
        # the earlier form broadcasts size-1 axes (a stride-0 access pattern), as NumPy does
        common = tuple(max(a, b) for a, b in zip(data1.shape, data2.shape, strict=True))
        data1, data2 = data1.broadcast_to(common), data2.broadcast_to(common)
    if legacy:
        dst = _new(data1.shape, dtype or _wider(data1.dtype, data2.dtype))
    if data1.buffer is PSUM and data2.buffer is PSUM:
        fail(ValueError, "tensor_tensor: data1 and data2 cannot both be in PSUM (one engine read port reaches PSUM)")
    _same_shape(dst, data1, "tensor_tensor")
    _same_shape(dst, data2, "tensor_tensor")
    cycles = engine_cycles(run.chip, eng, data1.free_size, data1.dtype.itemsize, inputs=2)
    _issue(f"tensor_tensor({op.name})", eng, cycles, [("data1", data1), ("data2", data2)], [("dst", dst)])
    if run.compute:
        _store(run, dst, op.fn(_rows(data1), _rows(data2)))
    _mark_written([("dst", dst)])
    return dst if legacy else None


def _wider(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if a.itemsize >= b.itemsize else b


def _binary(op: Op, x: torch.Tensor, y: Any, reverse: bool) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        y = torch.tensor(y, dtype=x.dtype if op.kind == "bitvec" else torch.float32)
    return op.fn(y, x) if reverse else op.fn(x, y)


def tensor_scalar(*args: Any, dst: NkiTensor | None = None, data: NkiTensor | None = None, op0: Any = None,
                  operand0: Any = None, reverse0: bool = False, op1: Any = None, operand1: Any = None,
                  reverse1: bool = False, engine: Any = None, dtype: Any = None, **_: Any) -> NkiTensor | None:
    """dst = (data <op0> operand0) <op1> operand1, operands scalars or [P, 1] tiles broadcast along the free axis;
    Vector engine by default (Scalar or GpSimd when asked)."""
    legacy = dst is None and (len(args) < 2 or not isinstance(args[1], NkiTensor))
    names = ["data", "op0", "operand0", "reverse0", "op1", "operand1", "reverse1"]
    if not legacy:
        names = ["dst", *names]
    given = dict(zip(names, args, strict=False))
    dst, data = given.get("dst", dst), given.get("data", data)
    op0, operand0, reverse0 = given.get("op0", op0), given.get("operand0", operand0), given.get("reverse0", reverse0)
    op1, operand1, reverse1 = given.get("op1", op1), given.get("operand1", operand1), given.get("reverse1", reverse1)
    run = core.current_run()
    eng = _engine_name(engine, "vector")
    if legacy:
        dst = _new(data.shape, dtype or data.dtype)
    _same_shape(dst, data, "tensor_scalar")
    p = data.shape[0]
    ops = [(_arith(op0, "tensor_scalar"), operand0, reverse0)]
    if op1 is not None:
        ops.append((_arith(op1, "tensor_scalar"), operand1, reverse1))
    for i, (op, operand, _) in enumerate(ops):
        if op in ALU_UNARY.values() and operand is not None and not (isinstance(operand, int | float) and operand == 0):
            fail(ValueError, f"tensor_scalar: operand{i} must be None or 0 for the unary operator nl.{op.name}")
    reads = [("data", data)] + [(f"operand{i}", o) for i, (_, o, _) in enumerate(ops) if isinstance(o, NkiTensor)]
    cycles = engine_cycles(run.chip, eng, data.free_size, data.dtype.itemsize)
    _issue("tensor_scalar", eng, cycles, reads, [("dst", dst)])
    if run.compute:
        x = _rows(data)
        for i, (op, operand, rev) in enumerate(ops):
            unary = op in ALU_UNARY.values()
            x = _binary(op, x, 0 if unary else _vector(operand, p, "tensor_scalar", f"operand{i}"), rev)
        _store(run, dst, x)
    _mark_written([("dst", dst)])
    return dst if legacy else None


def scalar_tensor_tensor(*args: Any, dst: NkiTensor | None = None, data: NkiTensor | None = None, op0: Any = None,
                         operand0: Any = None, op1: Any = None, operand1: NkiTensor | None = None,
                         reverse0: bool = False, reverse1: bool = False, dtype: Any = None,
                         **_: Any) -> NkiTensor | None:
    """dst = (data <op0> operand0) <op1> operand1 on the Vector engine: operand0 a scalar or [P, 1] tile,
    operand1 a tile shaped like data."""
    names = ["dst", "data", "op0", "operand0", "op1", "operand1", "reverse0", "reverse1"]
    given = dict(zip(names, args, strict=False))
    dst, data = given.get("dst", dst), given.get("data", data)
    op0, operand0, op1, operand1 = (given.get(k, v) for k, v in
                                    (("op0", op0), ("operand0", operand0), ("op1", op1), ("operand1", operand1)))
    reverse0, reverse1 = given.get("reverse0", reverse0), given.get("reverse1", reverse1)
    legacy = dst is None
    run = core.current_run()
    if legacy:
        dst = _new(data.shape, dtype or data.dtype)
    _same_shape(dst, data, "scalar_tensor_tensor")
    _same_shape(operand1, data, "scalar_tensor_tensor")
    if data.buffer is PSUM and operand1.buffer is PSUM:
        fail(ValueError, "scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    reads = [("data", data), ("operand1", operand1)] + ([("operand0", operand0)]
                                                         if isinstance(operand0, NkiTensor) else [])
    cycles = engine_cycles(run.chip, "vector", data.free_size, data.dtype.itemsize, inputs=2)
    _issue("scalar_tensor_tensor", "vector", cycles, reads, [("dst", dst)])
    if run.compute:
        x = _binary(_arith(op0, "scalar_tensor_tensor"), _rows(data),
                    _vector(operand0, data.shape[0], "scalar_tensor_tensor", "operand0"), reverse0)
        x = _binary(_arith(op1, "scalar_tensor_tensor"), x, _rows(operand1), reverse1)
        _store(run, dst, x)
    _mark_written([("dst", dst)])
    return dst if legacy else None


# what a masked-off element contributes to a reduction
_IDENTITY = {"add": 0.0, "sum": 0.0, "mean": 0.0, "multiply": 1.0, "prod": 1.0, "max": -math.inf,
             "maximum": -math.inf, "min": math.inf, "minimum": math.inf, "logical_and": 1.0, "logical_or": 0.0}


def tensor_reduce(*args: Any, dst: NkiTensor | None = None, op: Any = None, data: NkiTensor | None = None,
                  axis: Any = None, negate: bool = False, keepdims: bool = False, dtype: Any = None,
                  **_: Any) -> NkiTensor | None:
    """dst = op-reduction of data over free axes (never the partition axis 0) on the Vector engine."""
    legacy = dst is None and (not args or isinstance(as_op(args[0]), Op))
    names = ["op", "data", "axis", "negate", "keepdims"] if legacy else ["dst", "op", "data", "axis", "negate",
                                                                          "keepdims"]
    given = dict(zip(names, args, strict=False))
    dst, op, data, axis = given.get("dst", dst), given.get("op", op), given.get("data", data), given.get("axis", axis)
    negate, keepdims = given.get("negate", negate), given.get("keepdims", keepdims)
    op = as_op(op)
    if not isinstance(op, Op) or op.reduce is None:
        fail(ValueError, f"tensor_reduce: op must reduce (nl.add, nl.max, nl.min, nl.multiply), got {op!r}")
    axes = tuple(sorted({a % data.ndim for a in ((axis,) if isinstance(axis, int) else tuple(axis))}))
    if 0 in axes:
        fail(ValueError, "tensor_reduce reduces free axes only; reduce across partitions with a matmul or "
                         "nc_transpose first")
    run = core.current_run()
    shape = tuple(1 if i in axes else s for i, s in enumerate(data.shape)) if keepdims else \
        tuple(s for i, s in enumerate(data.shape) if i not in axes)
    if legacy:
        dst = _new(shape if len(shape) > 1 else (shape[0], 1), dtype or data.dtype)
    if dst.shape[0] != data.shape[0] or dst.data.numel() != math.prod(shape):
        fail(ValueError, f"tensor_reduce: dst must hold {shape}, got {dst.shape}")
    cycles = engine_cycles(run.chip, "vector", data.free_size, data.dtype.itemsize)
    _issue(f"tensor_reduce({op.name})", "vector", cycles, [("data", data)], [("dst", dst)])
    if run.compute:
        x, m = value(data), core.mask_for(data)
        if m is not None:  # masked-off elements do not take part
            x = torch.where(m, x, torch.tensor(_IDENTITY.get(op.name, 0.0)))
        r = op.reduce(x, axes)
        _store(run, dst, -r if negate else r)
    _mark_written([("dst", dst)])
    return dst if legacy else None


def tensor_copy(*args: Any, dst: NkiTensor | None = None, src: NkiTensor | None = None, engine: Any = None,
                dtype: Any = None, **_: Any) -> NkiTensor | None:
    """dst = src (cast to dst's dtype) on the Vector engine (or Scalar/GpSimd when asked): PSUM -> SBUF
    evacuation, casts, copies between tiles."""
    legacy = dst is None and _tiles(args) < 2
    if legacy:
        src = args[0] if args else src
    else:
        dst, src = (list(args) + [dst, src])[:2] if len(args) >= 2 else (args[0] if args else dst, src)
    run = core.current_run()
    eng = _engine_name(engine, "vector")
    if legacy:
        dst = _new(src.shape, dtype or src.dtype)
    _same_shape(dst, src, "tensor_copy")
    _issue("tensor_copy", eng, engine_cycles(run.chip, eng, src.free_size, src.dtype.itemsize),
           [("src", src)], [("dst", dst)])
    if run.compute:
        _store(run, dst, value(src))
    _mark_written([("dst", dst)])
    return dst if legacy else None


def reciprocal(*args: Any, dst: NkiTensor | None = None, data: NkiTensor | None = None, dtype: Any = None,
               **_: Any) -> NkiTensor | None:
    """dst = 1 / data on the Vector engine."""
    legacy = dst is None and _tiles(args) < 2
    if legacy:
        data = args[0] if args else data
    else:
        dst, data = (list(args) + [dst, data])[:2] if len(args) >= 2 else (args[0] if args else dst, data)
    run = core.current_run()
    if legacy:
        dst = _new(data.shape, dtype or data.dtype)
    _same_shape(dst, data, "reciprocal")
    _issue("reciprocal", "vector", engine_cycles(run.chip, "vector", data.free_size, data.dtype.itemsize),
           [("data", data)], [("dst", dst)])
    if run.compute:
        _store(run, dst, 1.0 / value(data))
    _mark_written([("dst", dst)])
    return dst if legacy else None


def memset(*args: Any, dst: NkiTensor | None = None, value: Any = None, engine: Any = None, dtype: Any = None,
           shape: Any = None, **_: Any) -> NkiTensor | None:
    """Fill dst with a constant (Vector engine)."""
    legacy = dst is None and (not args or not isinstance(args[0], NkiTensor))
    if legacy:
        shape, value, dtype = (list(args) + [shape, value, dtype])[:3] if len(args) >= 3 else \
            (*(list(args) + [shape, value][len(args):]), dtype)
    elif args:
        dst = args[0]
        value = args[1] if len(args) > 1 else value
    run = core.current_run()
    eng = _engine_name(engine, "vector")
    if legacy:
        dst = _new(tuple(shape), dtype)
    _issue("memset", eng, engine_cycles(run.chip, eng, dst.free_size, dst.dtype.itemsize), [], [("dst", dst)])
    if run.compute:
        _store(run, dst, torch.tensor(float(value)))
    _mark_written([("dst", dst)])
    return dst if legacy else None


# --------------------------------------------------------------------------------------------- GpSimd engine
def _affine(shape: tuple, pattern: list, offset: int, channel_multiplier: int, instr: str) -> torch.Tensor:
    p = shape[0]
    free = math.prod(shape[1:]) if len(shape) > 1 else 1
    pattern = [list(x) for x in pattern]
    if math.prod(n for _, n in pattern) != free:
        fail(ValueError, f"{instr}: pattern {pattern} generates {math.prod(n for _, n in pattern)} elements per "
                         f"partition, dst has {free}")
    vals = torch.zeros([n for _, n in pattern], dtype=torch.int64)
    for i, (step, n) in enumerate(pattern):
        shape_i = [1] * len(pattern)
        shape_i[i] = n
        vals = vals + (torch.arange(n) * step).reshape(shape_i)
    chan = torch.arange(p).reshape(p, 1) * channel_multiplier
    return (offset + chan + vals.reshape(1, -1)).float()


def iota(*args: Any, dst: NkiTensor | None = None, pattern: Any = None, offset: int = 0,
         channel_multiplier: int = 0, dtype: Any = None, **_: Any) -> NkiTensor | None:
    """dst[c, i...] = offset + c * channel_multiplier + sum(step_k * i_k) on the GpSimd engine (into SBUF).
    Legacy form: iota(nl.arange expression, dtype) returns its values as a tile."""
    if args and isinstance(args[0], core.IndexExpr):
        expr = args[0]
        dt = args[1] if len(args) > 1 else dtype
        v = expr.values
        v = v if v.dim() > 1 else v.reshape(1, -1)  # the expression's shape (a row for a 1-D arange)
        dst = _new(tuple(v.shape), dt)
        run = core.current_run()
        _issue("iota", "gpsimd", engine_cycles(run.chip, "gpsimd", dst.free_size, 4), [], [("dst", dst)])
        if run.compute:
            _store(run, dst, v.float())
        _mark_written([("dst", dst)])
        return dst
    names = ["dst", "pattern", "offset", "channel_multiplier"]
    given = dict(zip(names, args, strict=False))
    dst, pattern = given.get("dst", dst), given.get("pattern", pattern)
    offset, channel_multiplier = given.get("offset", offset), given.get("channel_multiplier", channel_multiplier)
    run = core.current_run()
    vals = _affine(dst.shape, pattern, offset, channel_multiplier, "iota")
    _issue("iota", "gpsimd", engine_cycles(run.chip, "gpsimd", dst.free_size, 4), [], [("dst", dst)])
    if run.compute:
        _store(run, dst, vals)
    _mark_written([("dst", dst)])
    return None


def affine_select(*args: Any, dst: NkiTensor | None = None, pattern: Any = None, offset: int = 0,
                  channel_multiplier: int = 0, on_true_tile: NkiTensor | None = None, on_false_value: float = 0.0,
                  cmp_op: Any = None, pred: Any = None, dtype: Any = None, **_: Any) -> NkiTensor | None:
    """dst = on_true_tile where cmp_op(offset + c * channel_multiplier + pattern . i, 0) else on_false_value, on
    the GpSimd engine (the causal mask of attention). Legacy form: affine_select(pred, on_true_tile,
    on_false_value), pred an nl.arange comparison."""
    run = core.current_run()
    if args and isinstance(args[0], core.IndexExpr) or isinstance(pred, core.IndexExpr):
        pred, on_true_tile, on_false_value = (list(args) + [None, None, 0.0])[:3] if args else \
            (pred, on_true_tile, on_false_value)
        dst = _new(on_true_tile.shape, dtype or on_true_tile.dtype)
        mask = pred.values.expand(on_true_tile.shape[0], -1).reshape(on_true_tile.shape[0], -1).bool()
        legacy = True
    else:
        names = ["dst", "pattern", "offset", "channel_multiplier", "on_true_tile", "on_false_value", "cmp_op"]
        given = dict(zip(names, args, strict=False))
        dst, pattern = given.get("dst", dst), given.get("pattern", pattern)
        offset, channel_multiplier = given.get("offset", offset), given.get("channel_multiplier", channel_multiplier)
        on_true_tile, on_false_value = given.get("on_true_tile", on_true_tile), given.get("on_false_value",
                                                                                          on_false_value)
        cmp = given.get("cmp_op", cmp_op) or OPS["equal"]
        mask = cmp.fn(_affine(dst.shape, pattern, offset, channel_multiplier, "affine_select"),
                      torch.tensor(0.0)).bool()
        legacy = False
    _same_shape(dst, on_true_tile, "affine_select")
    # GpSimd cannot reach PSUM. In the earlier form the compiler picks the engine and moves the instruction to
    # the Vector engine when an operand is in PSUM (AWS's reference flash attention selects on a PSUM tile this
    # way); the current form names its tiles and is refused.
    eng = "vector" if legacy and PSUM in (on_true_tile.buffer, dst.buffer) else "gpsimd"
    _issue("affine_select", eng, engine_cycles(run.chip, eng, dst.free_size, dst.dtype.itemsize),
           [("on_true_tile", on_true_tile)], [("dst", dst)])
    if run.compute:
        _store(run, dst, torch.where(mask, _rows(on_true_tile), torch.tensor(float(on_false_value))))
    _mark_written([("dst", dst)])
    return dst if legacy else None


def select(*args: Any, dst: NkiTensor | None = None, predicate: NkiTensor | None = None,
           on_true: NkiTensor | None = None, on_false: Any = None, **_: Any) -> NkiTensor | None:
    """dst = on_true where predicate != 0 else on_false (a tile, a [P, 1] tile or a scalar), Vector engine."""
    names = ["dst", "predicate", "on_true", "on_false"]
    given = dict(zip(names, args, strict=False))
    dst, predicate = given.get("dst", dst), given.get("predicate", predicate)
    on_true, on_false = given.get("on_true", on_true), given.get("on_false", on_false)
    run = core.current_run()
    legacy = dst is None
    if legacy:
        dst = _new(on_true.shape, on_true.dtype)
    _same_shape(dst, on_true, "select")
    _same_shape(dst, predicate, "select")
    reads = [("predicate", predicate), ("on_true", on_true)]
    if isinstance(on_false, NkiTensor):
        reads.append(("on_false", on_false))
    _issue("select", "vector", engine_cycles(run.chip, "vector", dst.free_size, dst.dtype.itemsize, inputs=2),
           reads, [("dst", dst)])
    if run.compute:
        p = dst.shape[0]
        f = _rows(on_false) if isinstance(on_false, NkiTensor) and on_false.free_size == dst.free_size else \
            _vector(on_false, p, "select", "on_false")
        f = f if isinstance(f, torch.Tensor) else torch.tensor(float(f))
        _store(run, dst, torch.where(_rows(predicate) != 0, _rows(on_true), f))
    _mark_written([("dst", dst)])
    return dst if legacy else None


def nc_stream_shuffle(*args: Any, dst: NkiTensor | None = None, src: NkiTensor | None = None,
                      shuffle_mask: Any = None, **_: Any) -> None:
    """Move whole partitions within each group of 32 (Vector engine): dst partition g*32+i takes src partition
    g*32+shuffle_mask[i] (a 32-entry list; 255 leaves dst's partition alone). In place is allowed."""
    g = _given(args, ["dst", "src", "shuffle_mask"], dst=dst, src=src, shuffle_mask=shuffle_mask)
    dst, src, mask = g["dst"], g["src"], list(g["shuffle_mask"])
    if len(mask) != 32:
        fail(ValueError, f"nc_stream_shuffle: shuffle_mask has 32 entries, got {len(mask)}")
    if dst.dtype != src.dtype or dst.free_size != src.free_size:
        fail(ValueError, f"nc_stream_shuffle: dst {dst.shape} {dst.dtype} and src {src.shape} {src.dtype} must "
                         "share the dtype and the elements per partition")
    run = core.current_run()
    _issue("nc_stream_shuffle", "vector", engine_cycles(run.chip, "vector", src.free_size, src.dtype.itemsize),
           [("src", src)] + ([("dst", dst)] if 255 in mask else []), [("dst", dst)])
    if run.compute:
        x = _rows(src).clone()
        out = _rows(dst).clone() if 255 in mask else torch.empty(dst.shape[0], dst.free_size)
        for row in range(dst.shape[0]):
            k = int(mask[row % 32])
            if k != 255:
                r = row - row % 32 + k
                out[row] = x[r if r < x.shape[0] else k]
        _store(run, dst, out)
    _mark_written([("dst", dst)])


def local_gather(*args: Any, dst: NkiTensor | None = None, src_buffer: NkiTensor | None = None,
                 index: NkiTensor | None = None, num_elem_per_idx: int = 1, num_valid_indices: int | None = None,
                 **_: Any) -> NkiTensor | None:
    """Gather within each GpSimd core's 16 partitions: the core flattens its 16 partitions of `index` (partition
    first), keeps num_valid_indices of them, and every partition p of the group takes, for each index i,
    src_buffer[p] flattened, elements i .. i + num_elem_per_idx - 1. index is uint16; partitions a multiple of 16."""
    legacy = dst is None and (len(args) < 3 or not isinstance(args[2], NkiTensor))
    g = _given(args, ["src_buffer", "index", "num_elem_per_idx", "num_valid_indices"] if legacy else
               ["dst", "src_buffer", "index", "num_elem_per_idx", "num_valid_indices"],
               dst=dst, src_buffer=src_buffer, index=index)
    dst, src, index = g.get("dst"), g["src_buffer"], g["index"]
    per, valid = int(g.get("num_elem_per_idx", num_elem_per_idx)), g.get("num_valid_indices", num_valid_indices)
    p = src.shape[0]
    if index.shape[0] != p or p % 16:
        fail(ValueError, f"local_gather: src_buffer and index need the same partition count, a multiple of 16; got "
                         f"{p} and {index.shape[0]}")
    if index.dtype != torch.uint16:
        fail(TypeError, f"local_gather: index must be uint16, got {index.dtype}")
    if per not in (1, 2, 4, 8, 16, 32):
        fail(ValueError, f"local_gather: num_elem_per_idx must be 1, 2, 4, 8, 16 or 32, got {per}")
    n = int(valid) if valid else 16 * index.free_size
    if n > min(4096, 16 * index.free_size):
        fail(ValueError, f"local_gather: {n} indices per core; at most {min(4096, 16 * index.free_size)}")
    run = core.current_run()
    if legacy:
        dst = _new((p, n * per), src.dtype)
    if dst.shape[0] != p or dst.free_size != n * per:
        fail(ValueError, f"local_gather: dst must hold [{p}, {n * per}] elements, got {dst.shape}")
    _issue("local_gather", "gpsimd", engine_cycles(run.chip, "gpsimd", n * per, src.dtype.itemsize),
           [("src_buffer", src), ("index", index)], [("dst", dst)])
    if run.compute:
        x, ix = _rows(src), _rows(index).long()
        out = torch.empty(p, n * per, dtype=x.dtype)
        for c in range(p // 16):
            rows = slice(16 * c, 16 * c + 16)
            flat = ix[rows].T.reshape(-1)[:n]  # partition first
            cols = (flat[:, None] + torch.arange(per)).reshape(-1)
            if int(cols.max()) >= x.shape[1]:
                fail(IndexError, f"local_gather: index {int(flat.max())} reads past the {x.shape[1]} elements of "
                                 "a partition")
            out[rows] = x[rows][:, cols]
        _store(run, dst, out)
    _mark_written([("dst", dst)])
    return dst if legacy else None


def rand(shape: Any, dtype: Any = torch.float32, **_: Any) -> NkiTensor:
    """`nl.rand(shape)`: a new SBUF tile of uniform [0, 1) draws (GpSimd engine) from the run's generator (seeded
    by nl.random_seed), not the hardware's random number generator."""
    run = core.current_run()
    dst = _new(tuple(shape), dtype)
    _issue("rand", "gpsimd", engine_cycles(run.chip, "gpsimd", dst.free_size, 4), [], [("dst", dst)])
    if run.compute:
        _store(run, dst, torch.rand(dst.shape, generator=run.generator))
    _mark_written([("dst", dst)])
    return dst


def dropout(*args: Any, dst: NkiTensor | None = None, data: NkiTensor | None = None, prob: Any = None,
            dtype: Any = None, **_: Any) -> NkiTensor | None:
    """dst = data with each element replaced by 0 with probability prob (a scalar or a [P, 1] tile); the kept
    ones are not rescaled. Vector engine; the draws come from the run's generator (`nl.random_seed`), not the
    hardware's random number generator."""
    legacy = dst is None and _tiles(args) < 2
    names = ["data", "prob"] if legacy else ["dst", "data", "prob"]
    given = dict(zip(names, args, strict=False))
    dst, data, prob = given.get("dst", dst), given.get("data", data), given.get("prob", prob)
    run = core.current_run()
    if legacy:
        dst = _new(data.shape, dtype or data.dtype)
    _same_shape(dst, data, "dropout")
    reads = [("data", data)] + ([("prob", prob)] if isinstance(prob, NkiTensor) else [])
    _issue("dropout", "vector", engine_cycles(run.chip, "vector", data.free_size, data.dtype.itemsize), reads,
           [("dst", dst)])
    if run.compute:
        x = _rows(data)
        p = _vector(prob, x.shape[0], "dropout", "prob")
        keep = torch.rand(x.shape, generator=run.generator) >= p
        _store(run, dst, torch.where(keep, x, torch.tensor(0.0)))
    _mark_written([("dst", dst)])
    return dst if legacy else None


# ------------------------------------------------------------------ Vector engine: accumulators, selection, top-8
def _given(args: tuple, names: list, **kw: Any) -> dict:
    """Positional arguments by AWS's parameter order, then the keywords given."""
    out = dict(zip(names, args, strict=False))
    out.update({k: v for k, v in kw.items() if v is not None or k not in out})
    return out


def _accumulate(run: core.Run, cmd: Any, op: Op, x: torch.Tensor, init: Any = None) -> torch.Tensor:
    """The Vector engine's accumulator registers after reducing x ([P, F]) along the free axis with `op`:
    reset (to op's identity), keep (reduce) or load `init` (load_reduce) first, per reduce_cmd."""
    p = x.shape[0]
    ident = torch.full((p, 1), _IDENTITY.get(op.name, 0.0))
    regs = run.vec_regs if run.vec_regs is not None and run.vec_regs.shape[0] == p else ident
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        regs = ident
    elif cmd == reduce_cmd.load_reduce:
        regs = _vector(init, p, "accumulate", "imm1")
        regs = regs if isinstance(regs, torch.Tensor) else torch.full((p, 1), float(regs))
    if cmd != reduce_cmd.reset:
        regs = op.fn(regs, op.reduce(x, (1,)).reshape(p, 1)) if op.reduce is not None else regs
    run.vec_regs = regs
    return regs


def tensor_copy_predicated(*args: Any, dst: NkiTensor | None = None, src: Any = None,
                           predicate: NkiTensor | None = None, reverse_pred: bool = False,
                           **_: Any) -> None:
    """dst = src where predicate (!= 0) else dst unchanged (Vector engine); src a tile or a scalar; src and
    predicate not both in PSUM."""
    g = _given(args, ["dst", "src", "predicate", "reverse_pred"], dst=dst, src=src, predicate=predicate)
    dst, src, predicate, reverse_pred = g["dst"], g["src"], g["predicate"], g.get("reverse_pred", reverse_pred)
    run = core.current_run()
    _same_shape(dst, predicate, "tensor_copy_predicated")
    if isinstance(src, NkiTensor):
        _same_shape(dst, src, "tensor_copy_predicated")
        if src.buffer is PSUM and predicate.buffer is PSUM:
            fail(ValueError, "tensor_copy_predicated: src and predicate cannot both be in PSUM")
    reads = [("predicate", predicate), ("dst", dst)] + ([("src", src)] if isinstance(src, NkiTensor) else [])
    _issue("tensor_copy_predicated", "vector", engine_cycles(run.chip, "vector", dst.free_size,
                                                             dst.dtype.itemsize, inputs=2), reads, [("dst", dst)])
    if run.compute:
        take = (_rows(predicate) != 0) ^ bool(reverse_pred)
        v = _rows(src) if isinstance(src, NkiTensor) else torch.tensor(float(src))
        _store(run, dst, torch.where(take, v, _rows(dst)))
    _mark_written([("dst", dst)])


def tensor_scalar_cumulative(*args: Any, dst: NkiTensor | None = None, src: NkiTensor | None = None,
                             op0: Any = None, op1: Any = None, imm0: Any = None, imm1: Any = None,
                             reduce_cmd: Any = reduce_cmd.reset_reduce, reverse0: bool = False,
                             **_: Any) -> NkiTensor | None:
    """A running reduction along the free axis (Vector engine): reg = op1(op0(src[i], imm0), reg), dst[i] = reg;
    reg starts at op1's identity (reset_reduce), imm1 (load_reduce) or where the last accumulation left it
    (reduce)."""
    g = _given(args, ["dst", "src", "op0", "op1", "imm0", "imm1", "reduce_cmd"], dst=dst, src=src, op0=op0,
               op1=op1, imm0=imm0, imm1=imm1)
    dst, src, imm0, imm1 = g.get("dst"), g["src"], g.get("imm0"), g.get("imm1")
    op0, op1 = _arith(g["op0"], "tensor_scalar_cumulative"), _arith(g["op1"], "tensor_scalar_cumulative")
    cmd = g.get("reduce_cmd", reduce_cmd)
    if op1.name not in ("add", "subtract", "multiply", "maximum", "minimum", "max", "min"):
        fail(ValueError, f"tensor_scalar_cumulative: op1 must be add, subtract, multiply, max or min, got {op1!r}")
    run = core.current_run()
    legacy = dst is None
    if legacy:
        dst = _new(src.shape, src.dtype)
    _same_shape(dst, src, "tensor_scalar_cumulative")
    reads = [("src", src)] + [(r, t) for r, t in (("imm0", imm0), ("imm1", imm1)) if isinstance(t, NkiTensor)]
    _issue("tensor_scalar_cumulative", "vector",
           engine_cycles(run.chip, "vector", src.free_size, src.dtype.itemsize), reads, [("dst", dst)])
    if run.compute:
        x = _rows(src)
        p = x.shape[0]
        y = _binary(op0, x, _vector(imm0, p, "tensor_scalar_cumulative", "imm0"), reverse0)
        ident = torch.full((p, 1), _IDENTITY.get(op1.name, 0.0))
        reg = ident if run.vec_regs is None or run.vec_regs.shape[0] != p else run.vec_regs
        if cmd == type(cmd).reset_reduce or cmd == type(cmd).reset:
            reg = ident
        elif cmd == type(cmd).load_reduce:
            v = _vector(imm1, p, "tensor_scalar_cumulative", "imm1")
            reg = v if isinstance(v, torch.Tensor) else torch.full((p, 1), float(v))
        cols = []
        for i in range(y.shape[1]):
            reg = op1.fn(y[:, i:i + 1], reg)
            cols.append(reg)
        run.vec_regs = reg
        _store(run, dst, torch.cat(cols, 1))
    _mark_written([("dst", dst)])
    return dst if legacy else None


def select_reduce(*args: Any, dst: NkiTensor | None = None, predicate: NkiTensor | None = None,
                  on_true: NkiTensor | None = None, on_false: Any = None, reduce_res: NkiTensor | None = None,
                  reduce_cmd: Any = reduce_cmd.idle, reduce_op: Any = None, reverse_pred: bool = False,
                  **_: Any) -> NkiTensor | None:
    """dst = on_true where predicate else on_false (a scalar or [P, 1]), and optionally the running max of dst
    per partition into reduce_res (Vector engine)."""
    g = _given(args, ["dst", "predicate", "on_true", "on_false", "reduce_res", "reduce_cmd", "reduce_op",
                      "reverse_pred"], dst=dst, predicate=predicate, on_true=on_true, on_false=on_false,
               reduce_res=reduce_res)
    dst, predicate, on_true, on_false, reduce_res = (g.get(k) for k in ("dst", "predicate", "on_true", "on_false",
                                                                         "reduce_res"))
    cmd, reverse_pred = g.get("reduce_cmd", reduce_cmd), g.get("reverse_pred", reverse_pred)
    op = as_op(g.get("reduce_op", reduce_op) or OPS["maximum"])
    if op.name not in ("maximum", "max"):
        fail(ValueError, f"select_reduce: reduce_op supports only nl.maximum, got {op!r}")
    run = core.current_run()
    legacy = dst is None
    if legacy:
        dst = _new(on_true.shape, on_true.dtype)
    _same_shape(dst, on_true, "select_reduce")
    _same_shape(dst, predicate, "select_reduce")
    if on_true.buffer is PSUM and predicate.buffer is PSUM:
        fail(ValueError, "select_reduce: on_true and predicate cannot both be in PSUM")
    reads = [("predicate", predicate), ("on_true", on_true)] + \
        ([("on_false", on_false)] if isinstance(on_false, NkiTensor) else [])
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    _issue("select_reduce", "vector", engine_cycles(run.chip, "vector", dst.free_size, dst.dtype.itemsize,
                                                    inputs=2), reads, writes)
    if run.compute:
        p = dst.shape[0]
        take = (_rows(predicate) != 0) ^ bool(reverse_pred)
        f = _vector(on_false, p, "select_reduce", "on_false")
        out = torch.where(take, _rows(on_true), f if isinstance(f, torch.Tensor) else torch.tensor(float(f)))
        _store(run, dst, out)
        if cmd != type(cmd).idle:
            regs = _accumulate(run, cmd, OPS["max"], value(dst).reshape(p, -1))
            if reduce_res is not None:
                _store(run, reduce_res, regs)
    _mark_written(writes)
    return dst if legacy else None


def range_select(*args: Any, dst: NkiTensor | None = None, on_true_tile: NkiTensor | None = None,
                 comp_op0: Any = None, comp_op1: Any = None, bound0: NkiTensor | None = None,
                 bound1: NkiTensor | None = None, reduce_cmd: Any = reduce_cmd.reset_reduce,
                 reduce_res: NkiTensor | None = None, reduce_op: Any = None, range_start: int = 0,
                 on_false_value: float = -3.4028234663852886e38, **_: Any) -> NkiTensor | None:
    """dst = on_true_tile where comp_op0(i, bound0) and comp_op1(i, bound1) for free index i (+ range_start),
    else on_false_value (FP32_MIN); the per-partition max also goes to the accumulator / reduce_res (Vector
    engine, NeuronCore-v3 and newer)."""
    g = _given(args, ["dst", "on_true_tile", "comp_op0", "comp_op1", "bound0", "bound1"], dst=dst,
               on_true_tile=on_true_tile, comp_op0=comp_op0, comp_op1=comp_op1, bound0=bound0, bound1=bound1)
    dst, src, b0, b1 = g.get("dst"), g["on_true_tile"], g["bound0"], g["bound1"]
    c0, c1 = as_op(g["comp_op0"]), as_op(g["comp_op1"])
    run = core.current_run()
    if run.chip.core_version == "NeuronCore-v2":
        fail(ValueError, "range_select needs NeuronCore-v3 or newer (trn2, trn3)")
    for c in (c0, c1):
        if not isinstance(c, Op) or c.name not in ("equal", "less", "less_equal", "greater", "greater_equal"):
            fail(ValueError, f"range_select: comparisons are nl.equal, less, less_equal, greater, greater_equal; "
                             f"got {c!r}")
    op = as_op(reduce_op or OPS["maximum"])
    if op.name not in ("maximum", "max"):
        fail(ValueError, f"range_select: reduce_op supports only nl.maximum, got {op!r}")
    legacy = dst is None
    if legacy:
        dst = _new(src.shape, src.dtype)
    _same_shape(dst, src, "range_select")
    writes = [("dst", dst)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    _issue("range_select", "vector", engine_cycles(run.chip, "vector", src.free_size, src.dtype.itemsize),
           [("on_true_tile", src), ("bound0", b0), ("bound1", b1)], writes)
    if run.compute:
        x = _rows(src)
        p = x.shape[0]
        idx = (range_start + torch.arange(x.shape[1], dtype=torch.float32)).reshape(1, -1)
        keep = (c0.fn(idx, _vector(b0, p, "range_select", "bound0")) != 0) & \
            (c1.fn(idx, _vector(b1, p, "range_select", "bound1")) != 0)
        out = torch.where(keep, x, torch.tensor(float(on_false_value)))
        _store(run, dst, out)
        regs = _accumulate(run, reduce_cmd, OPS["max"], out)
        if reduce_res is not None:
            _store(run, reduce_res, regs)
    _mark_written(writes)
    return dst if legacy else None


def max8(*args: Any, dst: NkiTensor | None = None, src: NkiTensor | None = None, dtype: Any = None,
         **_: Any) -> NkiTensor | None:
    """dst[P, 8] = the 8 largest values of each partition of src (8..16,384 elements), descending (Vector
    engine)."""
    g = _given(args, ["dst", "src"], dst=dst, src=src)
    dst, src = g.get("dst"), g["src"]
    if not 8 <= src.free_size <= 16384:
        fail(ValueError, f"max8: each partition must hold 8 to 16,384 elements, got {src.free_size}")
    run = core.current_run()
    legacy = dst is None
    if legacy:
        dst = _new((src.shape[0], 8), dtype or src.dtype)
    if dst.shape[0] != src.shape[0] or dst.free_size != 8:
        fail(ValueError, f"max8: dst must be [{src.shape[0]}, 8], got {dst.shape}")
    _issue("max8", "vector", engine_cycles(run.chip, "vector", src.free_size, src.dtype.itemsize),
           [("src", src)], [("dst", dst)])
    if run.compute:
        x, m = _rows(src).float(), core.mask_for(src)
        if m is not None:
            x = torch.where(m.reshape(x.shape), x, torch.tensor(-math.inf))
        _store(run, dst, x.topk(8, dim=1).values)
    _mark_written([("dst", dst)])
    return dst if legacy else None


_NOT_FOUND = {torch.uint16: 0xFFFF, torch.uint32: 0xFFFFFFFF}


def nc_find_index8(*args: Any, dst: NkiTensor | None = None, data: NkiTensor | None = None,
                   vals: NkiTensor | None = None, dtype: Any = None, **_: Any) -> NkiTensor | None:
    """dst[P, 8] = the index of the first occurrence of each of the 8 vals in data's partition (uint32 by
    default; all ones when absent). Duplicate vals take successive occurrences, in order (Vector engine)."""
    g = _given(args, ["dst", "data", "vals"], dst=dst, data=data, vals=vals)
    dst, data, vals = g.get("dst"), g["data"], g["vals"]
    run = core.current_run()
    legacy = dst is None
    if legacy:
        dst = _new((data.shape[0], 8), dtype or torch.uint32)
    if vals.free_size != 8 or dst.free_size != 8:
        fail(ValueError, "nc_find_index8: vals and dst hold exactly 8 elements per partition")
    _issue("nc_find_index8", "vector", engine_cycles(run.chip, "vector", data.free_size, data.dtype.itemsize),
           [("data", data), ("vals", vals)], [("dst", dst)])
    if run.compute:
        _store(run, dst, _match8(_rows(data), _rows(vals), core.mask_for(data), reverse=False,
                                 none=_NOT_FOUND.get(dst.dtype, -1))[1])
    _mark_written([("dst", dst)])
    return dst if legacy else None


def _match8(x: torch.Tensor, vals: torch.Tensor, m: torch.Tensor | None, reverse: bool,
            none: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(matched positions [P, F] bool, index of each val [P, 8]): each val takes the first data position equal
    to it not taken yet, the vals visited in order (reverse: from the last)."""
    x = x.float()
    ok = torch.ones_like(x, dtype=torch.bool) if m is None else m.reshape(x.shape).clone()
    taken = torch.zeros_like(ok)
    idx = torch.full(vals.shape, float(none))
    order = range(vals.shape[1] - 1, -1, -1) if reverse else range(vals.shape[1])
    for j in order:
        hit = (x == vals[:, j:j + 1].float()) & ok & ~taken
        found = hit.any(1)
        first = hit.float().argmax(1)
        idx[found, j] = first[found].float()
        taken[found, first[found]] = True
    return taken, idx


def nc_match_replace8(*args: Any, dst: NkiTensor | None = None, data: NkiTensor | None = None,
                      vals: NkiTensor | None = None, imm: float = 0.0, dst_idx: NkiTensor | None = None,
                      **_: Any) -> NkiTensor | None:
    """dst = data with the first occurrence of each of the 8 vals replaced by imm; their indices into dst_idx
    when given (duplicate vals are matched from the last one, so the first position lands in the highest
    slot). Vector engine."""
    g = _given(args, ["dst", "data", "vals", "imm", "dst_idx"], dst=dst, data=data, vals=vals, dst_idx=dst_idx)
    dst, data, vals, dst_idx = g.get("dst"), g["data"], g["vals"], g.get("dst_idx")
    imm = g.get("imm", imm)
    run = core.current_run()
    legacy = dst is None
    if legacy:
        dst = _new(data.shape, data.dtype)
    _same_shape(dst, data, "nc_match_replace8")
    if vals.free_size != 8:
        fail(ValueError, f"nc_match_replace8: vals holds 8 elements per partition, got {vals.free_size}")
    writes = [("dst", dst)] + ([("dst_idx", dst_idx)] if dst_idx is not None else [])
    _issue("nc_match_replace8", "vector", engine_cycles(run.chip, "vector", data.free_size, data.dtype.itemsize),
           [("data", data), ("vals", vals)], writes)
    if run.compute:
        x = _rows(data)
        taken, idx = _match8(x, _rows(vals), core.mask_for(data), reverse=True,
                             none=_NOT_FOUND.get(dst_idx.dtype, -1) if dst_idx is not None else -1)
        _store(run, dst, torch.where(taken, torch.tensor(float(imm)), x))
        if dst_idx is not None:
            _store(run, dst_idx, idx)
    _mark_written(writes)
    return dst if legacy else None


def sequence_bounds(*args: Any, dst: NkiTensor | None = None, segment_ids: NkiTensor | None = None,
                    **_: Any) -> NkiTensor | None:
    """dst[1, 2, n]: for each element of segment_ids[1, n], the start and (exclusive) end index of its segment
    (a run of equal ids); id 0 is padding and gets (n, -1). GpSimd engine."""
    g = _given(args, ["dst", "segment_ids"], dst=dst, segment_ids=segment_ids)
    dst, seg = g.get("dst"), g["segment_ids"]
    if seg.shape[0] != 1:
        fail(ValueError, f"sequence_bounds: segment_ids has one partition, got {seg.shape[0]}")
    run = core.current_run()
    legacy = dst is None
    n = seg.free_size
    if legacy:
        dst = _new((1, 2, n), seg.dtype)
    if dst.free_size != 2 * n:
        fail(ValueError, f"sequence_bounds: dst must be [1, 2, {n}], got {dst.shape}")
    _issue("sequence_bounds", "gpsimd", engine_cycles(run.chip, "gpsimd", n, 4), [("segment_ids", seg)],
           [("dst", dst)])
    if run.compute:
        ids = _rows(seg).reshape(-1)
        start, end = torch.full((n,), float(n)), torch.full((n,), -1.0)
        i = 0
        while i < n:
            j = i
            while j + 1 < n and ids[j + 1] == ids[i]:
                j += 1
            if ids[i] != 0:
                start[i:j + 1], end[i:j + 1] = float(i), float(j + 1)  # the end is exclusive
            i = j + 1
        _store(run, dst, torch.stack([start, end]).reshape(1, 2, n))
    _mark_written([("dst", dst)])
    return dst if legacy else None


# --------------------------------------------------------------------------------------------- DMA
class oob_mode(enum.Enum):  # noqa: N801 (AWS's name)
    """What an indirect DMA does with an index outside the tensor: raise (error) or leave that element alone
    (skip)."""
    error = "error"
    skip = "skip"


class dge_mode(enum.Enum):  # noqa: N801
    """Which descriptor generator a DMA uses (software / hardware); the same transfer here."""
    unknown = "unknown"
    none = "none"
    swdge = "swdge"
    hwdge = "hwdge"


def dma_copy(*args: Any, dst: NkiTensor | None = None, src: NkiTensor | None = None, dst_rmw_op: Any = None,
             oob_mode: oob_mode = oob_mode.error, **_: Any) -> None:
    """dst = src (or dst <dst_rmw_op> src) by a DMA engine: HBM <-> SBUF, HBM <-> HBM, SBUF <-> SBUF; never PSUM.
    The element counts must match; a dtype change is cast as the DMA's data path does. With
    oob_mode=oob_mode.skip, elements whose computed index falls outside the tensor are not transferred."""
    dst, src = (list(args) + [dst, src])[:2] if len(args) >= 2 else (args[0] if args else dst, src)
    skip = [t.valid for t in (dst, src) if isinstance(t, core.GatherTile) and t.indirect and t.valid is not None] \
        if oob_mode == type(oob_mode).skip else []
    _dma("dma_copy", dst, src, as_op(dst_rmw_op) if dst_rmw_op is not None else None, skip)


def _dma(instr: str, dst: NkiTensor, src: NkiTensor, rmw: Any = None, skip: list = (),
         transpose: bool | tuple[int, ...] = False) -> None:
    run = core.current_run()
    _operand_masks([dst, src], list(skip))
    _check_access("dma", instr, [("src", src)], [("dst", dst)])
    if dst.data.numel() != src.data.numel():
        fail(ValueError, f"{instr}: dst {dst.shape} and src {src.shape} hold different element counts")
    if src.buffer.on_chip or dst.buffer.on_chip:
        for role, t in (("src", src), ("dst", dst)):
            if t.buffer.on_chip and t.pdim != 0:
                fail(ValueError, f"{instr}: {role} still has block axes before its partition axis: index them")
    _check_initialised(instr, [("src", src)], [("dst", dst)])
    reads = [src] + ([dst] if rmw is not None else [])
    line = core._user_frame()[1]
    nbytes = src.data.numel() * src.dtype.itemsize
    eff = 1.0
    if transpose:
        eff = 0.9 if src.buffer.is_hbm else 0.5  # DMA transpose: ~90% of DMA throughput from HBM, ~50% SBUF->SBUF
    if not core.masked_off():
        run.timeline.dma(instr, nbytes, min(row_bytes(src), row_bytes(dst)), reads, [dst], line, eff)
    if run.compute:
        v = value(src)
        if isinstance(transpose, tuple):  # an N-d dma_transpose's axis permutation
            v = v.permute(transpose)
        elif transpose:
            v = v.reshape(src.shape[0], -1).T
        v = v.reshape(dst.shape)
        if rmw is not None:
            v = _binary(rmw, value(dst), v, False)
        _store(run, dst, v)
    _mark_written([("dst", dst)])


def dma_transpose(*args: Any, dst: NkiTensor | None = None, src: NkiTensor | None = None, axes: Any = None,
                  **_: Any) -> NkiTensor | None:
    """dst[F, P] = src[P, F] by the DMA engine (a 2-D transpose while moving)."""
    legacy = dst is None and _tiles(args) < 2
    if legacy:
        src = args[0] if args else src
        dst = _new((src.free_size, src.shape[0]), src.dtype)
    else:
        dst, src = (list(args) + [dst, src])[:2] if len(args) >= 2 else (args[0] if args else dst, src)
    if src.ndim in (3, 4) and dst.ndim == src.ndim:  # AWS's permutations: 3-d [2, 1, 0], 4-d [3, 1, 2, 0]
        perm = (2, 1, 0) if src.ndim == 3 else (3, 1, 2, 0)
        want = tuple(src.shape[i] for i in perm)
        if dst.shape != want:
            fail(ValueError, f"dma_transpose: a {src.ndim}-d src {src.shape} permuted by {list(perm)} is {want}; "
                             f"dst is {dst.shape}")
        _dma("dma_transpose", dst, src, transpose=perm)
        return None
    if dst.shape[0] != src.free_size or dst.free_size != src.shape[0]:
        fail(ValueError, f"dma_transpose: dst must be [{src.free_size}, {src.shape[0]}], got {dst.shape}")
    _dma("dma_transpose", dst, src, transpose=True)
    return dst if legacy else None


def tensor_scalar_reduce(*args: Any, dst: NkiTensor | None = None, data: NkiTensor | None = None, op0: Any = None,
                         operand0: Any = None, reduce_op: Any = None, reduce_res: NkiTensor | None = None,
                         reverse0: bool = False, dtype: Any = None, **_: Any) -> NkiTensor | None:
    """dst = data <op0> operand0, and reduce_res[P, 1] = reduce_op over dst's free axes (Vector engine)."""
    names = ["dst", "data", "op0", "operand0", "reduce_op", "reduce_res", "reverse0"]
    given = dict(zip(names, args, strict=False))
    dst, data, op0, operand0 = (given.get(k, v) for k, v in
                                (("dst", dst), ("data", data), ("op0", op0), ("operand0", operand0)))
    reduce_op, reduce_res = as_op(given.get("reduce_op", reduce_op)), given.get("reduce_res", reduce_res)
    reverse0 = given.get("reverse0", reverse0)
    legacy = dst is None
    run = core.current_run()
    if legacy:
        dst = _new(data.shape, dtype or data.dtype)
    _same_shape(dst, data, "tensor_scalar_reduce")
    if not isinstance(reduce_op, Op) or reduce_op.reduce is None:
        fail(ValueError, f"tensor_scalar_reduce: reduce_op must reduce (nl.add, nl.max, ...), got {reduce_op!r}")
    p = data.shape[0]
    reads = [("data", data)] + ([("operand0", operand0)] if isinstance(operand0, NkiTensor) else [])
    cycles = engine_cycles(run.chip, "vector", data.free_size, data.dtype.itemsize) + run.chip.mm_min_cycles
    _issue("tensor_scalar_reduce", "vector", cycles, reads, [("dst", dst), ("reduce_res", reduce_res)])
    if run.compute:
        x = _binary(_arith(op0, "tensor_scalar_reduce"), _rows(data),
                    _vector(operand0, p, "tensor_scalar_reduce", "operand0"), reverse0)
        _store(run, dst, x)
        _store(run, reduce_res, reduce_op.reduce(value(dst).reshape(p, -1), (1,)).reshape(p, 1))
    _mark_written([("dst", dst), ("reduce_res", reduce_res)])
    return dst if legacy else None


def bn_stats(*args: Any, dst: NkiTensor | None = None, data: NkiTensor | None = None, dtype: Any = None,
             **_: Any) -> NkiTensor | None:
    """Per-partition statistics of data[P, F] (F <= 512) for bn_aggr, on the Vector engine: dst[P, 6] holds
    (count, mean, count * variance) and three zeros (this model's layout of AWS's opaque 6-value record)."""
    legacy = dst is None and _tiles(args) < 2
    if legacy:
        data = args[0] if args else data
    else:
        dst, data = (list(args) + [dst, data])[:2] if len(args) >= 2 else (args[0] if args else dst, data)
    run = core.current_run()
    if data.free_size > 512:
        fail(ValueError, f"bn_stats: at most 512 elements per partition (nl.tile_size.bn_stats_fmax), got "
                         f"{data.free_size}")
    if legacy:
        dst = _new((data.shape[0], 6), dtype or torch.float32)
    if dst.shape[0] != data.shape[0] or dst.free_size != 6:
        fail(ValueError, f"bn_stats: dst must be [{data.shape[0]}, 6], got {dst.shape}")
    _issue("bn_stats", "vector", engine_cycles(run.chip, "vector", data.free_size, data.dtype.itemsize),
           [("data", data)], [("dst", dst)])
    if run.compute:
        x, m = _rows(data), core.mask_for(data)
        w = torch.ones_like(x) if m is None else m.reshape(x.shape).float()  # masked-off elements do not count
        x = torch.where(w > 0, x, torch.tensor(0.0))
        n = w.sum(1, keepdim=True)
        mean = x.sum(1, keepdim=True) / n.clamp(min=1)
        m2 = (w * (x - mean) ** 2).sum(1, keepdim=True)
        _store(run, dst, torch.cat([n, mean, m2, torch.zeros(x.shape[0], 3)], 1))
    _mark_written([("dst", dst)])
    return dst if legacy else None


def bn_aggr(*args: Any, dst: NkiTensor | None = None, data: NkiTensor | None = None, dtype: Any = None,
            **_: Any) -> NkiTensor | None:
    """Merge bn_stats records data[P, 6k] into dst[P, 2] = (mean, variance) per partition (Vector engine)."""
    legacy = dst is None and _tiles(args) < 2
    if legacy:
        data = args[0] if args else data
    else:
        dst, data = (list(args) + [dst, data])[:2] if len(args) >= 2 else (args[0] if args else dst, data)
    run = core.current_run()
    if data.free_size % 6:
        fail(ValueError, f"bn_aggr: data must hold whole 6-value bn_stats records, got {data.free_size} per partition")
    if legacy:
        dst = _new((data.shape[0], 2), dtype or torch.float32)
    if dst.shape[0] != data.shape[0] or dst.free_size != 2:
        fail(ValueError, f"bn_aggr: dst must be [{data.shape[0]}, 2], got {dst.shape}")
    _issue("bn_aggr", "vector", engine_cycles(run.chip, "vector", data.free_size, 4), [("data", data)],
           [("dst", dst)])
    if run.compute:
        rec = _rows(data).reshape(data.shape[0], -1, 6)
        n, mean, m2 = rec[..., 0], rec[..., 1], rec[..., 2]
        total = n.sum(1, keepdim=True)
        mu = (n * mean).sum(1, keepdim=True) / total
        var = (m2.sum(1, keepdim=True) + (n * (mean - mu) ** 2).sum(1, keepdim=True)) / total
        _store(run, dst, torch.cat([mu, var], 1))
    _mark_written([("dst", dst)])
    return dst if legacy else None


def tensor_partition_reduce(*args: Any, dst: NkiTensor | None = None, op: Any = None,
                            data: NkiTensor | None = None, dtype: Any = None, **_: Any) -> NkiTensor | None:
    """dst[1, F] = op-reduction of data[P, F] across its partitions, on the GpSimd engine."""
    legacy = dst is None and (not args or isinstance(as_op(args[0]), Op))
    names = ["op", "data"] if legacy else ["dst", "op", "data"]
    given = dict(zip(names, args, strict=False))
    dst, op, data = given.get("dst", dst), as_op(given.get("op", op)), given.get("data", data)
    if not isinstance(op, Op) or op.reduce is None:
        fail(ValueError, f"tensor_partition_reduce: op must reduce (nl.add, nl.max, ...), got {op!r}")
    run = core.current_run()
    if legacy:
        dst = _new((1, *data.shape[1:]), dtype or data.dtype)
    if dst.shape[0] != 1 or dst.free_size != data.free_size:
        fail(ValueError, f"tensor_partition_reduce: dst must be [1, {data.free_size}], got {dst.shape}")
    _issue(f"tensor_partition_reduce({op.name})", "gpsimd",
           engine_cycles(run.chip, "gpsimd", data.free_size, data.dtype.itemsize) * max(1, data.shape[0] // 16),
           [("data", data)], [("dst", dst)])
    if run.compute:
        _store(run, dst, op.reduce(_rows(data), (0,)).reshape(1, -1))
    _mark_written([("dst", dst)])
    return dst if legacy else None


def tensor_tensor_scan(*args: Any, dst: NkiTensor | None = None, data0: NkiTensor | None = None,
                       data1: NkiTensor | None = None, initial: Any = 0.0, op0: Any = None, op1: Any = None,
                       reverse0: bool = False, reverse1: bool = False, dtype: Any = None,
                       **_: Any) -> NkiTensor | None:
    """A scan along the free axis on the Vector engine: r[i] = (data0[i] <op0> r[i-1]) <op1> data1[i], r[-1] =
    initial (a scalar or a [P, 1] tile)."""
    legacy = dst is None and _tiles(args[:3]) < 3
    names = ["data0", "data1", "initial", "op0", "op1"] if legacy else ["dst", "data0", "data1", "initial", "op0",
                                                                        "op1"]
    given = dict(zip(names, args, strict=False))
    dst, data0, data1 = given.get("dst", dst), given.get("data0", data0), given.get("data1", data1)
    initial, op0, op1 = given.get("initial", initial), given.get("op0", op0), given.get("op1", op1)
    op0, op1 = _arith(op0, "tensor_tensor_scan"), _arith(op1, "tensor_tensor_scan")
    run = core.current_run()
    if legacy:
        dst = _new(data0.shape, dtype or data0.dtype)
    _same_shape(dst, data0, "tensor_tensor_scan")
    _same_shape(dst, data1, "tensor_tensor_scan")
    reads = [("data0", data0), ("data1", data1)] + ([("initial", initial)] if isinstance(initial, NkiTensor) else [])
    _issue("tensor_tensor_scan", "vector",
           engine_cycles(run.chip, "vector", data0.free_size, data0.dtype.itemsize, inputs=2), reads, [("dst", dst)])
    if run.compute:
        a, b = _rows(data0), _rows(data1)
        r = _vector(initial, a.shape[0], "tensor_tensor_scan", "initial")
        r = r if isinstance(r, torch.Tensor) else torch.full((a.shape[0], 1), float(r))
        cols = []
        for i in range(a.shape[1]):
            r = _binary(op1, _binary(op0, a[:, i:i + 1], r, reverse0), b[:, i:i + 1], reverse1)
            cols.append(r)
        _store(run, dst, torch.cat(cols, 1))
    _mark_written([("dst", dst)])
    return dst if legacy else None


core.accept_masks(globals())
core.provide(dma_copy=dma_copy, tensor_copy=tensor_copy, memset=memset, accumulate_psum=accumulate_psum,
             tensor_tensor=tensor_tensor, assign_result=assign_result)
