"""`nki.language` (imported as `nl`): dtypes, buffers, tensor creation, indexing helpers, loop ranges, the SPMD
program ids, and the elementwise / reduction / memory operators, each lowered onto `nki.isa` instructions the way
the NKI compiler does (math on the Scalar engine's activation, binary ops on the Vector engine, loads and stores
by DMA)."""
from __future__ import annotations

import builtins
import contextlib
import inspect
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import core, isa, ops
from .core import HBM, PRIVATE_HBM, PSUM, SBUF, SHARED_HBM, DynSlice, IndexExpr, NkiTensor, ParDim, fail
from .ops import OPS, Op

# dtypes (torch dtypes; numpy dtypes and names are accepted everywhere a dtype is)
float32 = tfloat32 = torch.float32
bfloat16 = torch.bfloat16
float16 = torch.float16
float8_e4m3 = float8_e4m3fn = torch.float8_e4m3fn
float8_e5m2 = torch.float8_e5m2
int8, uint8, int16, uint16, int32, uint32 = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32,
                                             torch.uint32)
bool_ = torch.bool
DType = torch.dtype  # dtypes here are torch dtypes
float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4 = (core.PackedDType("float8_e4m3fn_x4"),
                                                     core.PackedDType("float8_e5m2_x4"),
                                                     core.PackedDType("float4_e2m1fn_x4"))

# buffers
hbm, shared_hbm, private_hbm, sbuf, psum = HBM, SHARED_HBM, PRIVATE_HBM, SBUF, PSUM


@dataclass(frozen=True)
class _TileSize:
    """`nl.tile_size`: the hardware's tile limits (S12, S22)."""

    pmax: int = 128
    psum_fmax: int = 512
    gemm_stationary_fmax: int = 128
    gemm_moving_fmax: int = 512
    bn_stats_fmax: int = 512
    psum_partition_max: int = 128
    psum_bank_fmax: int = core.PSUM_BANK_BYTES // 4  # float32 elements per partition in one PSUM bank
    psum_bank_fmax_bytes: int = core.PSUM_BANK_BYTES

    @property
    def psum_num_banks(self) -> int:
        return core.current_run().psum_bank_count

    @property
    def sbuf_fmax_bytes(self) -> int:
        """Usable SBUF bytes per partition of the modelled chip."""
        return core.current_run().sbuf_partition_bytes

    total_available_sbuf_size = sbuf_fmax_bytes  # AWS's deprecated name (per partition, despite it)

    @property
    def sbuf_fmax(self) -> int:
        return self.sbuf_fmax_bytes // 4

    @property
    def sbuf_size_bytes(self) -> int:
        return self.sbuf_fmax_bytes * core.PMAX


tile_size = _TileSize()

# operators (functions on tiles, and the op= of nki.isa)
globals().update(OPS)
add, subtract, multiply, divide = OPS["add"], OPS["subtract"], OPS["multiply"], OPS["divide"]
maximum, minimum, power = OPS["maximum"], OPS["minimum"], OPS["power"]
exp, log, tanh, sigmoid, relu, gelu = OPS["exp"], OPS["log"], OPS["tanh"], OPS["sigmoid"], OPS["relu"], OPS["gelu"]
rsqrt, sqrt, square, silu = OPS["rsqrt"], OPS["sqrt"], OPS["square"], OPS["silu"]
sum, max, min, mean, prod = OPS["sum"], OPS["max"], OPS["min"], OPS["mean"], OPS["prod"]  # noqa: A001
abs, negative = OPS["abs"], OPS["negative"]  # noqa: A001
equal, greater, greater_equal, less, less_equal = (OPS["equal"], OPS["greater"], OPS["greater_equal"],
                                                   OPS["less"], OPS["less_equal"])


# ------------------------------------------------------------------------------------------ creation
def par_dim(size: int) -> ParDim:
    return ParDim(size)


def ndarray(shape: Any, dtype: Any, buffer: core.Buffer = SBUF, name: str = "", address: Any = None,
            **_: Any) -> NkiTensor:
    """A new (uninitialised) tensor in `buffer`, optionally at `address` (partition, byte offset)."""
    return core.allocate(shape, dtype, buffer, address=address if buffer.on_chip else None)


def empty_like(t: NkiTensor, dtype: Any = None, buffer: core.Buffer | None = None, **_: Any) -> NkiTensor:
    return ndarray(t.shape, dtype or t.dtype, buffer or (t.buffer if t.buffer.on_chip else SBUF))


def full(shape: Any, fill_value: float, dtype: Any, buffer: core.Buffer = SBUF, **_: Any) -> NkiTensor:
    t = ndarray(shape, dtype, buffer)
    if buffer.is_hbm:
        t.data.fill_(fill_value)
    else:  # one memset per block (the axes before an nl.par_dim), as the compiler emits them
        for block in itertools.product(*(range(n) for n in t.shape[:t.pdim])):
            isa.memset(dst=t[block] if block else t, value=fill_value)
    return t


def zeros(shape: Any, dtype: Any, buffer: core.Buffer = SBUF, **kw: Any) -> NkiTensor:
    return full(shape, 0.0, dtype, buffer)


def ones(shape: Any, dtype: Any, buffer: core.Buffer = SBUF, **kw: Any) -> NkiTensor:
    return full(shape, 1.0, dtype, buffer)


def zeros_like(t: NkiTensor, dtype: Any = None, buffer: core.Buffer | None = None, **_: Any) -> NkiTensor:
    return zeros(t.shape, dtype or t.dtype, buffer or (t.buffer if t.buffer.on_chip else SBUF))


def shared_identity_matrix(n: int, dtype: Any = torch.float32, **_: Any) -> NkiTensor:
    """An n x n identity in SBUF (built by iota + compare on GpSimd, as a kernel would)."""
    t = ndarray((n, n), dtype, SBUF)
    isa.iota(dst=t, pattern=[[1, n]], offset=0, channel_multiplier=-1)
    run = core.current_run()
    if run.compute:
        t.data.copy_((t.data.float() == 0).to(t.dtype))
    return t


# ------------------------------------------------------------------------------------------ indexing and loops
def ds(start: int, size: int, step: int = 1) -> DynSlice:
    """A slice of `size` elements from `start` (nl.ds)."""
    return DynSlice(int(start), int(size), int(step))


def arange(*args: int) -> IndexExpr:
    """Indices for legacy affine indexing (`t[i_p, i_f]` with i_p = nl.arange(128)[:, None])."""
    return IndexExpr(torch.arange(*args))


class _MGrid:
    """`nl.mgrid[0:p, 0:f, ...]`: index expressions for each axis, as `.p` (partitions) then `.x`, `.y`, `.z`."""

    def __getitem__(self, key: Any) -> Any:
        key = key if isinstance(key, tuple) else (key,)
        n = len(key)
        exprs = []
        for i, k in enumerate(key):
            shape = [1] * n
            r = torch.arange(k.start or 0, k.stop, k.step or 1)
            shape[i] = r.numel()
            exprs.append(IndexExpr(r.reshape(shape)))
        grid = _Grid(exprs)
        return grid


class _Grid(tuple):
    def __new__(cls, exprs: list) -> _Grid:
        return super().__new__(cls, exprs)

    def __getattr__(self, name: str) -> IndexExpr:
        order = {"p": 0, "x": 1, "y": 2, "z": 3}
        if name not in order or order[name] >= len(self):
            raise AttributeError(name)
        return self[order[name]]


mgrid = _MGrid()


def shared_constant(value: Any, dtype: Any = None, **_: Any) -> NkiTensor:
    """A constant HBM tensor from a host array."""
    t = torch.as_tensor(value)
    dtype = core.to_dtype(dtype) if dtype is not None else t.dtype
    return core.allocate(tuple(t.shape), dtype, HBM, data=t.to(dtype).clone())


def spmd_dim(*sizes: int) -> int:
    """`kernel[nl.spmd_dim(n, nl.nc(2)), ...]`: a grid axis of n x 2 programs spread over logical cores (here
    they run one after another on the modelled core, like every SPMD program)."""
    return math.prod(int(s) for s in sizes)


def nc(n: int) -> int:
    """`nl.nc(n)`: n NeuronCores, a factor of an `nl.spmd_dim` grid axis."""
    return int(n)


def static_cast(x: Any, dtype: Any) -> Any:
    """A host array cast to `dtype` (NumPy in, NumPy out). bfloat16 / float8 have no NumPy dtype here (no
    ml_dtypes): the result holds the values rounded to that dtype as float32, tagged with the dtype, and a kernel
    receives it as a tensor of that dtype (`core.HostCast`)."""
    d = core.to_dtype(dtype)
    t = torch.tensor(np.asarray(x))  # a copy: the input may be a read-only view
    if d in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return core.HostCast.of(t.to(d).float().numpy(), d)
    return t.to(d).numpy()


class _NKIObjectType(type):
    """Construction of an NKIObject class: keyword arguments its __init__ does not take become attributes. AWS's
    kernels construct `@dataclass` subclasses whose fields are unannotated class attributes (no __init__
    parameters) with keyword arguments, e.g. nki-library's attention_cte `SectionParams(section_idx=...)`."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        params = inspect.signature(cls.__init__).parameters
        if builtins.any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return super().__call__(*args, **kwargs)
        obj = super().__call__(*args, **{k: v for k, v in kwargs.items() if k in params})
        for name, value in kwargs.items():
            if name not in params:
                setattr(obj, name, value)
        return obj


class NKIObject(metaclass=_NKIObjectType):
    """The base class of kernels' configuration objects and dataclasses (AWS's nl.NKIObject): a plain object here,
    its keyword arguments set as attributes."""

    def __init__(self, **kwargs: Any) -> None:
        for name, value in kwargs.items():
            setattr(self, name, value)


finfo = torch.finfo  # nl.finfo(dtype).min / .max
fp32 = torch.finfo(torch.float32)  # nl.fp32.min: the most negative float32 (the -inf stand-in of kernels)
Tensor = NkiTensor  # the type of tiles (annotations)


def loop_reduce(x: NkiTensor, op: Any, loop_indices: Any = (), dtype: Any = None, **_: Any) -> core.LoopReduce:
    """`dst[...] = nl.loop_reduce(x, op=np.add, loop_indices=[i])`: dst accumulates x over the loop on i (a
    Vector-engine tensor_tensor per iteration; dst must be initialised before the loop)."""
    return core.LoopReduce(x, ops.as_op(op), core.CURRENT.mask)


def random_seed(seed: Any, **_: Any) -> None:
    """Seed the draws of `nl.dropout` (an int, or a [1, 1] tile's value)."""
    run = core.current_run()
    if isinstance(seed, NkiTensor):
        isa._check_initialised("random_seed", [("seed", seed)])
        seed = int(seed.data.flatten()[0].item()) if run.compute else 0
    run.generator.manual_seed(int(seed))


rand = isa.rand


def dropout(x: NkiTensor, rate: Any, dtype: Any = None, **_: Any) -> NkiTensor:
    """x with each element zeroed with probability rate (nisa.dropout)."""
    return isa.dropout(x, rate, dtype=dtype)


def affine_range(*args: int, **_: Any) -> range:
    """A loop whose iterations are independent (the compiler may pipeline them; the timeline orders them only
    by their data dependencies)."""
    return range(*args)


def sequential_range(*args: int, **_: Any) -> range:
    """A loop with a carried dependency (its order is kept by the data dependencies it has)."""
    return range(*args)


def static_range(*args: int, **_: Any) -> range:
    """A loop the compiler unrolls."""
    return range(*args)


def program_id(axis: int = 0) -> int:
    """This SPMD program's index along `axis` of the launch grid (`kernel[g0, g1](...)`)."""
    run = core.current_run()
    if not run.program:
        return 0
    if not 0 <= axis < len(run.program):
        fail(ValueError, f"program_id({axis}): the launch grid has {len(run.program)} axes")
    return run.program[axis]


def num_programs(axes: int | tuple[int, ...] | None = 0, axis: int | None = None) -> int:
    """Programs along `axes` of the launch grid (AWS's keyword; `axis=` as earlier kernels write it): one axis, the
    product over a tuple of axes, or the whole grid for None."""
    run = core.current_run()
    axes = axes if axis is None else axis
    if not run.grid:
        return 1
    picked = range(len(run.grid)) if axes is None else (axes,) if isinstance(axes, int) else tuple(axes)
    for a in picked:
        if not 0 <= a < len(run.grid):
            fail(ValueError, f"num_programs({a}): the launch grid has {len(run.grid)} axes")
    return math.prod(run.grid[a] for a in picked)


def program_ndim() -> int:
    return len(core.current_run().grid)


def device_print(prefix: str, t: NkiTensor) -> None:
    print(prefix, t.data)


# ------------------------------------------------------------------------------------------ memory
def load(src: NkiTensor, dtype: Any = None, **_: Any) -> NkiTensor:
    """HBM -> a new SBUF tile (a DMA); a single element loads as a [1, 1] tile."""
    dst = core.result_tile(src.shape or (1, 1), dtype or src.dtype, SBUF)
    isa.dma_copy(dst=dst, src=src)
    return dst


def store(dst: NkiTensor, value: NkiTensor, **_: Any) -> None:
    """SBUF -> HBM (a DMA); a PSUM value is first copied to SBUF, as the compiler does; a scalar value fills
    dst (a memset of an SBUF tile, then the DMA)."""
    if not isinstance(value, NkiTensor):
        value = full(dst.shape if dst.ndim > 1 else (1, dst.shape[0]), value, dst.dtype)
    if value.buffer is PSUM:
        value = copy(value)
    isa.dma_copy(dst=dst, src=value)


def load_transpose2d(src: NkiTensor, dtype: Any = None, **_: Any) -> NkiTensor:
    dst = core.result_tile((src.free_size, src.shape[0]), dtype or src.dtype, SBUF)
    isa.dma_transpose(dst=dst, src=src)
    return dst


def copy(x: NkiTensor, dtype: Any = None, **_: Any) -> NkiTensor:
    """A copy of a tile in SBUF (Vector engine), cast to dtype."""
    dst = core.result_tile(x.shape, dtype or x.dtype, SBUF)
    isa.tensor_copy(dst=dst, src=x)
    return dst


def matmul(x: NkiTensor, y: NkiTensor, transpose_x: bool = False, **_: Any) -> NkiTensor:
    """x @ y into a new PSUM tile (x.T @ y if transpose_x); without transpose_x, x is first transposed on the
    Tensor engine (through PSUM, copied back to SBUF)."""
    if not transpose_x:
        x = copy(transpose(x), dtype=x.dtype)
    x = copy(x) if x.buffer is PSUM else x  # the compiler moves PSUM operands to SBUF for nl-level calls
    y = copy(y) if y.buffer is PSUM else y
    out = core.result_tile((x.free_size, y.free_size), torch.float32, PSUM)
    out.alloc.matmul_result = True  # `psum += nl.matmul(...)` accumulates, as the legacy nc_matmul form does
    isa.nc_matmul(dst=out, stationary=x, moving=y)
    return out


def transpose(x: NkiTensor, dtype: Any = None, **_: Any) -> NkiTensor:
    """x.T into a new PSUM tile (Tensor engine)."""
    x = copy(x) if x.buffer is PSUM else x
    out = core.result_tile((x.free_size, x.shape[0]), dtype or torch.float32, PSUM)
    isa.nc_transpose(dst=out, data=x)
    return out


def broadcast_to(x: NkiTensor, shape: Any, **_: Any) -> NkiTensor:
    """`nl.broadcast_to(t, shape)`: t's size-1 axes repeated (a stride-0 view, as `t.broadcast_to`)."""
    return x.broadcast_to(shape)


def where(condition: NkiTensor, x: Any, y: Any, dtype: Any = None, **_: Any) -> NkiTensor:
    tiles = [t for t in (condition, x, y) if isinstance(t, NkiTensor)]
    if len({t.ndim for t in tiles}) == 1 and len({t.shape for t in tiles}) > 1:  # NumPy's broadcasting
        common = tuple(builtins.max(n) for n in zip(*(t.shape for t in tiles), strict=True))
        condition, x, y = (t.broadcast_to(common) if isinstance(t, NkiTensor) else t for t in (condition, x, y))
    like = x if isinstance(x, NkiTensor) else condition
    dst = core.result_tile(like.shape, dtype or like.dtype, SBUF)
    if not isinstance(x, NkiTensor):
        x = full(like.shape, float(x), dst.dtype)
    isa.select(dst=dst, predicate=condition, on_true=x, on_false=y)
    return dst


# ------------------------------------------------------------------------------------------ operators as functions
def _is_vector(t: Any, p: int) -> bool:
    return isinstance(t, NkiTensor) and t.shape[0] == p and t.free_size == 1


def apply_op(op: Op, *args: Any, dtype: Any = None, axis: Any = None, keepdims: bool = False, **_: Any) -> Any:
    """`nl.<op>(...)` on tiles: activations on the Scalar engine, binary ops on the Vector engine (tensor_scalar
    when one side is a scalar or a [P, 1] column), reductions with tensor_reduce."""
    if op.kind == "act":
        (x,) = args[:1]
        if op.name == "reciprocal":
            return isa.reciprocal(x, dtype=dtype)
        return isa.activation(op, x, dtype=dtype)
    if op.kind == "reduce" or (axis is not None and op.reduce is not None and len(args) == 1):
        x = args[0]
        if axis is None:
            axis = tuple(range(1, x.ndim))
        if op.name == "mean":
            s = isa.tensor_reduce(OPS["add"], x, axis, keepdims=keepdims, dtype=dtype or torch.float32)
            n = x.data[(0,) + (slice(None),) * (x.ndim - 1)].numel() // s.data[0].numel()
            return isa.tensor_scalar(s, OPS["multiply"], 1.0 / n)
        return isa.tensor_reduce(op, x, axis, keepdims=keepdims, dtype=dtype)
    if op.name == "invert":  # the ALU's unary bitwise NOT (a Vector-engine tensor_scalar, operand unused)
        return isa.tensor_scalar(args[0], op, 0, dtype=dtype)
    a, b = args[:2]
    if not isinstance(a, NkiTensor) and not isinstance(b, NkiTensor):
        return op.fn(torch.tensor(a), torch.tensor(b)).item()
    if dtype is None and op.kind == "arith":
        dtype = _promoted(a, b, op)
    if not isinstance(a, NkiTensor):
        return isa.tensor_scalar(b, op, a, True, dtype=dtype)
    if isinstance(b, NkiTensor) and a.shape != b.shape and a.ndim == b.ndim and _broadcastable(a.shape, b.shape) \
            and not (_is_vector(a, a.shape[0]) or _is_vector(b, b.shape[0])) or \
            isinstance(b, NkiTensor) and a.shape[0] != b.shape[0] and 1 in (a.shape[0], b.shape[0]):
        # NumPy's broadcasting: size-1 axes read repeatedly (stride-0 access patterns; a one-partition tile read
        # by every partition)
        common = tuple(builtins.max(x, y) for x, y in zip(a.shape, b.shape, strict=True))
        a, b = a.broadcast_to(common), b.broadcast_to(common)
    p = a.shape[0]
    if not isinstance(b, NkiTensor) or (_is_vector(b, p) and a.free_size > 1):
        return isa.tensor_scalar(a, op, b, dtype=dtype)
    if _is_vector(a, p) and b.free_size > 1:
        return isa.tensor_scalar(b, op, a, True, dtype=dtype)
    if a.shape != b.shape and a.free_size == b.free_size and a.shape[0] == b.shape[0]:
        b = b.reshape(a.shape) if b.data.is_contiguous() else b
    if a.free_size != b.free_size or a.shape[0] != b.shape[0]:
        fail(ValueError, f"nl.{op.name}: shapes {a.shape} and {b.shape} do not match; engines broadcast only a "
                         "scalar or a [P, 1] column along the free axis")
    return isa.tensor_tensor(a, b, op, dtype=dtype)


def _broadcastable(x: tuple, y: tuple) -> bool:
    return builtins.all(m == n or 1 in (m, n) for m, n in zip(x, y, strict=True))


def _promoted(a: Any, b: Any, op: Op) -> torch.dtype | None:
    """The result dtype of integer operands where NumPy's promotion makes it float: a division, or a Python
    float operand (`idx_tile / 7`, `idx_tile * 0.5`); None otherwise (the tiles' own)."""
    tiles = [t for t in (a, b) if isinstance(t, NkiTensor)]
    if any(t.dtype.is_floating_point for t in tiles):
        return None
    if op.name == "divide" or any(isinstance(x, float) for x in (a, b)):
        return torch.float32
    return None


def all(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False, **_: Any) -> NkiTensor:  # noqa: A001
    """Whether every element along the free axes is non-zero (a logical-and reduction, Vector engine)."""
    return OPS["logical_and"](x, axis=axis, dtype=dtype, keepdims=keepdims)


def logical_not(x: NkiTensor, dtype: Any = None, **_: Any) -> NkiTensor:
    """1 where x is 0, else 0 (AWS's XOR with 1, for 0/1 inputs; a Vector-engine tensor_scalar)."""
    return OPS["logical_xor"](x, 1, dtype=dtype or x.dtype)


def var(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False, **_: Any) -> NkiTensor:
    """Population variance over free axes, mean((x - mean(x))^2); AWS's result keeps the reduced axes (keepdims
    is ignored there too)."""
    d = x - OPS["mean"](x, axis=axis, keepdims=True)
    return OPS["mean"](OPS["square"](d), axis=axis, keepdims=True, dtype=dtype)


def rms_norm(x: NkiTensor, w: NkiTensor, axis: Any, n: int, epsilon: float = 1e-6, dtype: Any = None,
             compute_dtype: Any = None, **_: Any) -> NkiTensor:
    """x / sqrt(sum(x^2 over axis) / n + epsilon) * w: the square and its row sum on the Scalar engine, the scale on
    the Vector engine; w broadcasts from one partition."""
    if axis not in (1, -1, (1,), [1]) or x.ndim != 2:
        fail(ValueError, f"nl.rms_norm: normalises the free axis of a 2-D tile (axis 1), got axis {axis} of {x.shape}")
    sq = ndarray(x.shape, compute_dtype or torch.float32, SBUF)
    ss = ndarray((x.shape[0], 1), torch.float32, SBUF)
    isa.activation(dst=sq, op=OPS["square"], data=x, reduce_op=OPS["add"], reduce_res=ss)
    inv = isa.tensor_scalar(ss, OPS["multiply"], 1.0 / n, op1=OPS["add"], operand1=float(epsilon))
    inv = isa.activation(OPS["rsqrt"], inv)
    return OPS["multiply"](OPS["multiply"](x, inv), w, dtype=dtype or x.dtype)


def expand_dims(x: NkiTensor, axis: int) -> NkiTensor:
    """A view of x with a size-1 axis inserted at `axis`."""
    axis = axis % (x.ndim + 1)
    pdim = x.pdim + 1 if x.buffer.on_chip and axis <= x.pdim else x.pdim
    return NkiTensor(x.alloc, x.data.unsqueeze(axis), None, pdim)


def is_hbm(buffer: core.Buffer) -> bool:
    return buffer.is_hbm


def is_on_chip(buffer: core.Buffer) -> bool:
    return buffer.on_chip


def is_psum(buffer: core.Buffer) -> bool:
    return buffer is PSUM


def is_sbuf(buffer: core.Buffer) -> bool:
    return buffer is SBUF


@contextlib.contextmanager
def no_reorder() -> Iterator[None]:
    """A region the compiler keeps in program order: accepted; the timeline keeps each engine's program order and
    orders engines only by data dependencies (as outside the region)."""
    yield


def dynamic_range(start: int, stop: int | None = None, step: int = 1) -> range:
    """A loop with runtime bounds on hardware; here bounds are Python ints (registers are not implemented)."""
    if not builtins.all(isinstance(v, int) for v in (start, stop if stop is not None else 0, step)):
        fail(NotImplementedError, "nl.dynamic_range: bounds held in registers are not implemented; use ints")
    return range(start, stop, step) if stop is not None else range(start)


def softmax(x: NkiTensor, axis: int = -1, dtype: Any = None, **_: Any) -> NkiTensor:
    """softmax over the free axis: max (Vector), exp(x - max) with its row sum (Scalar), scale by 1/sum."""
    m = isa.tensor_reduce(OPS["max"], x, axis, negate=True, keepdims=True, dtype=torch.float32)
    e = ndarray(x.shape, torch.float32, SBUF)
    s = ndarray((x.shape[0], 1), torch.float32, SBUF)
    isa.activation(dst=e, op=OPS["exp"], data=x, bias=m, reduce_op=OPS["add"], reduce_res=s)
    r = isa.reciprocal(s)
    return isa.tensor_scalar(e, OPS["multiply"], r, dtype=dtype or x.dtype)


core.accept_masks(globals())
ops.provide(apply_op)
