"""The NKI machine state of one kernel call: buffers, tiles (views of torch tensors), the hardware rules and the
error that names the kernel's line.

A tile is an `NkiTensor`: a torch CPU view of its allocation, the buffer it lives in, its partition axis and the
box it covers (for the cost model's dependencies). SBUF/PSUM allocations carry an "initialised" mask, so a read of
memory no instruction wrote is an error, as on hardware it would be garbage. Capacities and limits come from
`hardware/chips.py`."""
from __future__ import annotations

import copy
import linecache
import math
import os
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..hardware.chips import CHIPS, Chip
from .ops import OPS

# The nki.isa instructions a tile's item assignment and `+=` issue (dma_copy, tensor_copy, memset, accumulate_psum,
# and assign_result, which redirects the instruction that made the value instead): nki.isa builds on this module,
# so it hands them over when it is imported (`provide`; nki.kernel imports it before any kernel runs) instead of
# this module importing it.
_ISSUED: dict[str, Callable[..., Any]] = {}


def provide(**instructions: Callable[..., Any]) -> None:
    _ISSUED.update(instructions)


def _issue(name: str) -> Callable[..., Any]:
    if name not in _ISSUED:
        raise RuntimeError(f"NKI: {name} is not available yet: import torchneuron.nki.isa (nki.isa) first")
    return _ISSUED[name]

_HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------------------------- dtypes
FORBIDDEN_DTYPES = {torch.float64: "float64", torch.int64: "int64", torch.complex64: "complex64",
                    torch.complex128: "complex128"}
_BY_NAME = {"float32": torch.float32, "tfloat32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16, "float8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
            "float8_e5m2": torch.float8_e5m2, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
            "uint16": torch.uint16, "int32": torch.int32, "uint32": torch.uint32, "bool": torch.bool,
            "bool_": torch.bool, "float64": torch.float64, "int64": torch.int64}


@dataclass(frozen=True)
class PackedDType:
    """AWS's MX packed dtypes (`nl.float8_e4m3fn_x4`, `float8_e5m2_x4`, `float4_e2m1fn_x4`: four elements in one
    value, for nki.isa.nc_matmul_mx on NeuronCore-v4). Kernels may name them (dtype lists, comparisons); tensors
    of them are not implemented, as nc_matmul_mx / quantize_mx are not."""

    name: str

    def __repr__(self) -> str:
        return f"nl.{self.name}"


def to_dtype(d: Any) -> torch.dtype:
    """A torch dtype from a torch dtype, numpy dtype or type, ml_dtypes type, or name."""
    if isinstance(d, torch.dtype):
        return d
    if isinstance(d, PackedDType):
        fail(NotImplementedError, f"{d!r}: MX packed dtypes (nki.isa.nc_matmul_mx, NeuronCore-v4) are not implemented")
    name = getattr(d, "name", None) or getattr(d, "__name__", None) or str(d)
    try:
        import numpy as np

        name = np.dtype(d).name
    except TypeError:
        pass
    if name not in _BY_NAME:
        fail(TypeError, f"unsupported NKI dtype {d!r}")
    return _BY_NAME[name]


def check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype in FORBIDDEN_DTYPES:
        fail(TypeError, f"{what} has dtype {FORBIDDEN_DTYPES[dtype]}, which NeuronCore engines do not compute: "
                        "cast to float32/bfloat16 (int32 for integers) before the kernel")


class HostCast(np.ndarray):
    """A NumPy array standing for one of a dtype NumPy lacks here (bfloat16, float8; AWS's kernels' tests get
    those from ml_dtypes): float32 values already rounded to `nki_dtype`, which results of NumPy arithmetic on it
    keep, and which a kernel argument is converted back to."""

    nki_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, values: np.ndarray, dtype: torch.dtype) -> HostCast:
        a = values.view(cls)
        a.nki_dtype = dtype
        return a

    def __array_finalize__(self, obj: Any) -> None:
        self.nki_dtype = getattr(obj, "nki_dtype", None)

    def to_tensor(self) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(self.view(np.ndarray)))
        return t.to(self.nki_dtype) if self.nki_dtype is not None else t


# ----------------------------------------------------------------------------------------------- buffers
@dataclass(frozen=True)
class Buffer:
    """A memory of the NeuronCore: HBM (device memory; shared between logical-core programs or private to one),
    or the on-chip SBUF and PSUM, both 128 partitions wide."""

    name: str

    @property
    def on_chip(self) -> bool:
        return self.name in ("sbuf", "psum")

    @property
    def is_hbm(self) -> bool:
        return not self.on_chip

    def __repr__(self) -> str:
        return f"nl.{self.name}"


HBM, SHARED_HBM, PRIVATE_HBM = Buffer("hbm"), Buffer("shared_hbm"), Buffer("private_hbm")
SBUF, PSUM = Buffer("sbuf"), Buffer("psum")


@dataclass(frozen=True)
class ParDim:
    """`nl.par_dim(n)`: marks the partition axis of an on-chip shape (the axes before it are block axes)."""

    size: int


# ----------------------------------------------------------------------------------------------- errors
class KernelFrame(threading.local):
    """The kernel call running on this thread (kernels queued on a stream run on its worker thread), and the
    `mask=` of the instruction being issued (a bool tensor broadcastable to its tiles; None: no mask)."""

    run: Run | None = None
    mask: torch.Tensor | None = None


CURRENT = KernelFrame()


def _user_frame() -> tuple[str, int, str]:
    """The innermost frame outside this package: the kernel's line."""
    f = sys._getframe(1)
    while f is not None and (os.path.dirname(os.path.abspath(f.f_code.co_filename)) == _HERE):
        f = f.f_back
    if f is None:
        return "<unknown>", 0, ""
    return f.f_code.co_filename, f.f_lineno, linecache.getline(f.f_code.co_filename, f.f_lineno).strip()


def where() -> str:
    path, line, src = _user_frame()
    run = CURRENT.run
    name = run.kernel_name if run else "kernel"
    return f"NKI kernel {name!r}, {os.path.basename(path)}:{line} `{src}`"


def fail(exc: type[BaseException], message: str) -> None:
    """Raise `exc` naming the kernel's source line."""
    raise exc(f"{where()}: {message}")


def current_run() -> Run:
    run = CURRENT.run
    if run is None:
        fail(RuntimeError, "NKI language calls run only inside an @nki.jit kernel call")
    return run


# ----------------------------------------------------------------------------------------------- run state
@dataclass
class Run:
    """One kernel call (one SPMD program at a time): the modelled chip, the timeline, live on-chip memory."""

    kernel_name: str
    chip: Chip
    compute: bool = True  # False: shapes, rules and cost only (values are not computed)
    stochastic_rounding: bool = False
    grid: tuple[int, ...] = ()
    program: tuple[int, ...] = ()
    timeline: Any = None  # cost.Timeline
    sbuf_used: int = 0  # bytes per partition
    psum_used: int = 0  # bytes per partition of live PSUM
    generator: torch.Generator = field(default_factory=torch.Generator)
    shared: SharedHbm | None = None  # the launch's shared_hbm tensors (SPMD programs share them)
    act_regs: torch.Tensor | None = None  # the Scalar engine's 128 reduction registers
    garbage_from: str = ""  # the first instruction that computed on uninitialised memory (for the error)
    vec_regs: torch.Tensor | None = None  # the Vector engine's per-partition accumulator registers

    @property
    def sbuf_partition_bytes(self) -> int:
        return self.chip.sbuf_bytes // PMAX

    @property
    def psum_bank_count(self) -> int:
        return self.chip.psum_bytes // PMAX // PSUM_BANK_BYTES


class SharedHbm:
    """The shared_hbm tensors of an SPMD launch: every program's i-th shared_hbm allocation is the same tensor."""

    def __init__(self) -> None:
        self.tensors: list[NkiTensor] = []
        self.next = 0


def chip_named(name: str) -> Chip:
    if name not in CHIPS:
        raise ValueError(f"unknown NKI target {name!r}: choose one of {', '.join(CHIPS)}")
    return CHIPS[name]


# ----------------------------------------------------------------------------------------------- hardware rules
PMAX = 128  # partitions of SBUF/PSUM and rows of the PE array: S12
PSUM_BANK_BYTES = 2048  # per partition: 8 banks x 2 KiB of PSUM, S12
SBUF_FREE_MAX = 64 * 1024  # elements per partition an engine instruction reads from SBUF: S12
PSUM_FREE_MAX = 4 * 1024  # ... from PSUM


class Allocation:
    """The memory behind one `nl.ndarray`: a torch tensor; on-chip memory is charged to the run while alive."""

    __slots__ = ("base", "buffer", "init", "run", "charge", "psum_charge", "written", "matmul_result", "mm_read",
                 "mask", "pdim", "poffset", "result", "__weakref__")

    def __init__(self, base: torch.Tensor, buffer: Buffer, run: Run | None, charge: int = 0, psum_charge: int = 0,
                 initialised: bool = False):
        self.base, self.buffer, self.run, self.charge, self.psum_charge = base, buffer, run, charge, psum_charge
        # numpy, not torch: single-threaded, so tiny masks never wait for a thread pool
        self.init = None if initialised or not buffer.on_chip else np.zeros(tuple(base.shape), dtype=np.bool_)
        self.written = False  # by an instruction (the timeline tracks reads only of memory that is ever written)
        self.matmul_result = False  # a PSUM tile returned by the legacy nc_matmul form (`psum += ...`)
        self.mm_read = True  # read since the last matmul wrote it: the next matmul starts a new accumulation
        self.mask: torch.Tensor | None = None  # the mask= of the legacy call that returned this tile
        self.pdim = 0  # the partition axis of `base` (after any nl.par_dim block axes)
        self.poffset = 0  # the first physical partition (`nl.ndarray(address=(partition, byte))`)
        self.result = False  # a call's result tile: assigned to a tile at once, its instruction writes there instead

    def __del__(self) -> None:
        run = getattr(self, "run", None)  # unset if __init__ did not finish
        if run is not None:
            run.sbuf_used -= self.charge
            run.psum_used -= self.psum_charge


def result_tile(shape: Any, dtype: Any, buffer: Buffer = SBUF) -> NkiTensor:
    """The new tile an nl/nisa call returns: assigned to a tile at once (`t[...] = nl.load(x)`), the instruction
    that made it writes that tile instead (nki.isa.assign_result)."""
    t = allocate(shape, dtype, buffer)
    t.alloc.result = True
    return t


def _shape_of(shape: Any) -> tuple[tuple[int, ...], int]:
    """(sizes, index of the partition axis) of a shape that may hold an nl.par_dim marker."""
    if isinstance(shape, int | ParDim):
        shape = (shape,)
    sizes, pdim = [], 0
    for i, s in enumerate(shape):
        if isinstance(s, ParDim):
            pdim, s = i, s.size
        sizes.append(int(s))
    return tuple(sizes), pdim


def allocate(shape: Any, dtype: Any, buffer: Buffer, data: torch.Tensor | None = None,
             address: tuple[int, int] | None = None) -> NkiTensor:
    """A new tensor in `buffer` (checked against the chip's partition count and capacities). At an explicit
    `address` (partition, byte offset per partition) the kernel manages the memory: the tensor must fit inside
    the buffer (a PSUM tile inside one bank) and is not charged to the allocator's running total, since such
    tensors may deliberately share space."""
    dtype = to_dtype(dtype)
    sizes, pdim = _shape_of(shape)
    check_dtype(dtype, f"nl.ndarray{sizes}")
    run = CURRENT.run
    if buffer is SHARED_HBM and run is not None and run.shared is not None and data is None:
        shared = run.shared
        shared.next += 1
        if shared.next <= len(shared.tensors):
            t = shared.tensors[shared.next - 1]
            if sizes != t.shape or dtype != t.dtype:
                fail(ValueError, "SPMD programs must allocate the same shared_hbm tensors in the same order")
            return t
        shared.tensors.append(t := allocate(shape, dtype, HBM))
        return t
    if any(s <= 0 for s in sizes):
        fail(ValueError, f"shape {sizes} has an empty axis")
    charge = psum_charge = 0
    if buffer.on_chip:
        if sizes[pdim] > PMAX:
            fail(ValueError, f"partition dimension {sizes[pdim]} of a {buffer.name} tensor exceeds {PMAX} "
                             f"(nl.tile_size.pmax): tile the axis into pieces of at most {PMAX}")
        free = math.prod(sizes[pdim + 1:]) * dtype.itemsize
        # Block axes (before an nl.par_dim): AWS's allocator may rotate fewer physical buffers than blocks, so one
        # block is charged (docs/nki.md).
        blocks = 1
        if address is not None:
            return _placed(sizes, pdim, dtype, buffer, run, free, address)
        if run is not None and buffer is SBUF:
            charge = free * blocks
            if run.sbuf_used + charge > run.sbuf_partition_bytes:
                fail(RuntimeError, f"SBUF overflow on {run.chip.name}: this {sizes} {_dn(dtype)} tensor needs "
                                   f"{charge} B per partition, {run.sbuf_used} B of "
                                   f"{run.sbuf_partition_bytes} B are live (nl.sbuf capacity)")
        if buffer is PSUM:
            if free > PSUM_BANK_BYTES:
                fail(ValueError, f"a PSUM tile's free size is {free} B per partition; a PSUM bank holds "
                                 f"{PSUM_BANK_BYTES} B (512 float32): split the tile")
            if run is not None:
                psum_charge = free * blocks  # bytes per partition (each block within one bank)
                limit = run.psum_bank_count * PSUM_BANK_BYTES
                if run.psum_used + psum_charge > limit:
                    fail(RuntimeError, f"PSUM overflow on {run.chip.name}: {run.psum_used} B of {limit} B per "
                                       f"partition (8 banks of 2 KiB) are live and this {sizes} tensor needs "
                                       f"{psum_charge} B more")
    if data is None:
        data = torch.empty(sizes, dtype=dtype)
    alloc = Allocation(data, buffer, run, charge, psum_charge, initialised=buffer.is_hbm)
    alloc.pdim = pdim if buffer.on_chip else 0
    if run is not None:
        run.sbuf_used += charge
        run.psum_used += psum_charge
    return NkiTensor(alloc, data, tuple((d, 0, 1, s) for d, s in enumerate(sizes)), pdim if buffer.on_chip else 0)


def _placed(sizes: tuple, pdim: int, dtype: torch.dtype, buffer: Buffer, run: Run | None, free: int,
            address: Any) -> NkiTensor:
    """An on-chip tensor at a kernel-chosen address (see `allocate`)."""
    part, byte = (int(a) for a in address)
    limit = PSUM_BANK_BYTES * 8 if buffer is PSUM else (run.sbuf_partition_bytes if run is not None else None)
    if part < 0 or part + sizes[pdim] > PMAX or byte < 0 or (limit is not None and byte + free > limit):
        fail(ValueError, f"address {address} places {free} B per partition on partitions {part}..."
                         f"{part + sizes[pdim] - 1}, outside {buffer.name} ({PMAX} partitions x {limit} B)")
    if buffer is PSUM and byte // PSUM_BANK_BYTES != (byte + free - 1) // PSUM_BANK_BYTES:
        fail(ValueError, f"address {address}: a PSUM tile of {free} B per partition crosses a 2 KiB bank boundary")
    data = torch.empty(sizes, dtype=dtype)
    alloc = Allocation(data, buffer, None)
    alloc.pdim, alloc.poffset = pdim, part
    return NkiTensor(alloc, data, tuple((d, 0, 1, s) for d, s in enumerate(sizes)), pdim)


def _dn(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------- tensors
class IndexExpr:
    """`nl.arange(n)` and affine expressions of it (legacy indexing): an integer tensor of indices."""

    __array_priority__ = 100

    def __init__(self, values: torch.Tensor, predicate: bool = False):
        self.values = values
        self.predicate = predicate  # a comparison (a mask), not indices

    def __getitem__(self, key: Any) -> IndexExpr:
        return IndexExpr(self.values[key])

    def _bin(self, other: Any, fn: Any) -> IndexExpr:
        return IndexExpr(fn(self.values, other.values if isinstance(other, IndexExpr) else other))

    def __add__(self, o): return self._bin(o, torch.add)
    __radd__ = __add__
    def __mul__(self, o): return self._bin(o, torch.mul)
    __rmul__ = __mul__
    def __sub__(self, o): return self._bin(o, torch.sub)
    def __rsub__(self, o): return IndexExpr(o - self.values)

    def _cmp(self, other: Any, fn: Any) -> IndexExpr:
        return IndexExpr(fn(self.values, other.values if isinstance(other, IndexExpr) else other).long(), True)

    def __ge__(self, o): return self._cmp(o, torch.ge)
    def __gt__(self, o): return self._cmp(o, torch.gt)
    def __le__(self, o): return self._cmp(o, torch.le)
    def __lt__(self, o): return self._cmp(o, torch.lt)
    def __eq__(self, o): return self._cmp(o, torch.eq)  # type: ignore[override]
    def __ne__(self, o): return self._cmp(o, torch.ne)  # type: ignore[override]
    __hash__ = None  # type: ignore[assignment]
    def __floordiv__(self, o): return self._bin(o, torch.floor_divide)
    def __mod__(self, o): return self._bin(o, torch.remainder)
    # predicates (comparisons give 0/1) combine into masks
    def __and__(self, o): return self._cmp(o, lambda a, b: (a * b) != 0)
    __rand__ = __and__
    def __or__(self, o): return self._cmp(o, lambda a, b: (a + b) > 0)
    __ror__ = __or__
    def __invert__(self): return IndexExpr(1 - self.values, True)

    def within(self, size: int) -> bool:
        """Whether every index lies in [0, size)."""
        v = self.values
        return v.numel() == 0 or (int(v.min()) >= 0 and int(v.max()) < size)

    def is_affine(self) -> bool:
        """Whether the indices are one increasing run along a single axis (then a slice gives a view)."""
        v = self.values
        if v.numel() != max(v.shape or (1,)):
            return False
        v = v.flatten()
        return v.numel() == 1 or (bool((v.diff() == v[1] - v[0]).all()) and int(v[1] - v[0]) > 0)

    def as_slice(self) -> slice:
        v = self.values.flatten()
        if v.numel() != max(self.values.shape) or (v.numel() > 1 and not bool((v.diff() == v[1] - v[0]).all())) \
                or (v.numel() > 1 and int(v[1] - v[0]) <= 0):
            fail(IndexError, "only increasing affine nl.arange index expressions are supported")
        step = int(v[1] - v[0]) if v.numel() > 1 else 1
        return slice(int(v[0]), int(v[-1]) + 1, step)


def _bounds(k: slice | DynSlice, size: int) -> tuple[int, int, int]:
    """(start, stop, step) of a slice or nl.ds over an axis of `size`: negative ends counted from the end, as
    Python's, the stop not clipped to the axis."""
    if isinstance(k, DynSlice):
        return int(k.start), int(k.start) + int(k.size) * int(k.step), int(k.step)
    step = 1 if k.step is None else int(k.step)
    start = 0 if k.start is None else int(k.start)
    stop = size if k.stop is None else int(k.stop)
    return start + size if start < 0 else start, stop + size if stop < 0 else stop, step


def _past_end(k: Any, size: int) -> bool:
    """Whether a slice or nl.ds reaches past the end of its axis (its last index, not its stop): like an nl.arange
    expression that does, it addresses a tile the instruction's mask= must cut to the tensor (AWS's rule), so it
    is a gathered tile."""
    if not isinstance(k, slice | DynSlice):
        return False
    start, stop, step = _bounds(k, size)
    return step > 0 and 0 <= start < stop and start + (len(range(start, stop, step)) - 1) * step >= size


def _reordered(key: tuple) -> bool:
    """Whether nl.arange expressions place the tensor's axes in another order in the tile (`t[i_f, i_p]` with
    i_p = arange[:, None], i_f = arange[None, :]: a transposed access, gathered element by element), or give the
    tile more axes than they index (`t[i_p]` of a 1-D tensor is a [n, 1] tile): either way the tile's shape is the
    expressions' broadcast shape."""
    exprs = [k for k in key if isinstance(k, IndexExpr)]
    if any(k.values.dim() > len(exprs) for k in exprs):
        return True
    order = []
    for k in key:
        if isinstance(k, IndexExpr):
            axes = [i for i, n in enumerate(k.values.shape) if n > 1]
            if len(axes) == 1:
                order.append(axes[0])
    return any(a >= b for a, b in zip(order, order[1:], strict=False))


@dataclass(frozen=True)
class DynSlice:
    """`nl.ds(start, size)`."""

    start: int
    size: int
    step: int = 1


class NkiTensor:
    """A tensor or tile of an NKI kernel: a view of its allocation's torch tensor."""

    __slots__ = ("alloc", "data", "dims", "fixed", "pdim", "pmask", "__weakref__")

    def __init__(self, alloc: Allocation, data: torch.Tensor, dims: tuple, pdim: int, fixed: tuple = ()):
        self.alloc, self.data, self.dims, self.pdim, self.fixed = alloc, data, dims, pdim, fixed
        self.pmask: torch.Tensor | None = None  # `tile[predicate]`: the instruction using it is masked

    # ---- metadata
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def buffer(self) -> Buffer:
        return self.alloc.buffer

    @property
    def ndim(self) -> int:
        return self.data.dim()

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"NkiTensor(shape={self.shape}, dtype={_dn(self.dtype)}, buffer={self.buffer!r})"

    def box(self) -> tuple:
        """The region of the allocation this view covers, per allocation axis (start, stop)."""
        out = [(0, s) for s in self.alloc.base.shape] if self.dims is None else [None] * self.alloc.base.dim()
        if self.dims is not None:
            for d, i in self.fixed:
                out[d] = (i, i + 1)
            for d, start, step, size in self.dims:
                out[d] = (start, start + step * (size - 1) + 1)
            out = [o if o is not None else (0, s) for o, s in zip(out, self.alloc.base.shape, strict=True)]
        return tuple(out)

    # ---- tiles
    @property
    def partitions(self) -> tuple[int, int]:
        """(first partition, partition count) of an on-chip tile."""
        if self.dims is None:
            if isinstance(self, GatherTile):
                return 0, self.shape[0]
            # a reshape or .ap() view: its first element's partition in the allocation
            base = self.alloc.base
            offset = self.data.storage_offset() - base.storage_offset()
            start = (offset // base.stride(self.alloc.pdim)) % base.shape[self.alloc.pdim]
            return self.alloc.poffset + start, self.shape[0]
        d, start, step, size = self.dims[0]
        return self.alloc.poffset + start, size

    @property
    def free_size(self) -> int:
        return math.prod(self.shape[1:]) if self.ndim > 1 else 1

    # ---- indexing
    def __getitem__(self, key: Any) -> NkiTensor:
        if isinstance(key, IndexExpr) and key.predicate:  # `tile[mask]`: the tile, its instruction masked
            t = NkiTensor(self.alloc, self.data, self.dims, self.pdim, self.fixed) if type(self) is NkiTensor \
                else copy.copy(self)
            t.pmask = key.values.bool() if self.pmask is None else self.pmask & key.values.bool()
            return t
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(i for i, k in enumerate(key) if k is Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1:]
        if len(key) > self.ndim:
            fail(IndexError, f"too many indices ({len(key)}) for a tensor of shape {self.shape}")
        if any(isinstance(k, NkiTensor) or (isinstance(k, IndexExpr) and (not k.is_affine() or not k.within(n)))
               for k, n in zip(key, self.shape, strict=False)) or _reordered(key):
            return GatherTile(self, key)
        if any(_past_end(k, n) for k, n in zip(key, self.shape, strict=False)):
            return GatherTile(self, self._as_arange(key))
        key = key + (slice(None),) * (self.ndim - len(key))
        key = self._keep_free_axis(key)
        torch_key, dims, fixed, pdim = [], [], list(self.fixed), self.pdim
        for axis, (k, size) in enumerate(zip(key, self.shape, strict=True)):
            dim = self.dims[axis] if self.dims is not None else None
            if isinstance(k, IndexExpr):
                k = k.as_slice()
            if isinstance(k, DynSlice):
                k = slice(k.start, k.start + k.size * k.step, k.step)
            keep_partition = self.buffer.on_chip and axis == self.pdim
            if isinstance(k, int) or (hasattr(k, "__index__") and not isinstance(k, slice)):
                i = int(k)
                j = i + size if i < 0 else i
                if not 0 <= j < size:
                    fail(IndexError, f"index {i} is out of bounds for axis {axis} of size {size} "
                                     f"(tensor shape {self.shape}, {self.buffer!r})")
                if keep_partition:
                    k = slice(j, j + 1)
                else:
                    torch_key.append(j)
                    if dim is not None:
                        fixed.append((dim[0], dim[1] + dim[2] * j))
                    if axis < self.pdim:
                        pdim -= 1
                    continue
            if not isinstance(k, slice):
                fail(TypeError, f"unsupported index {k!r}: use ints, slices, nl.ds or nl.arange expressions")
            start, stop, step = k.start, k.stop, k.step
            step = 1 if step is None else int(step)
            if step <= 0:
                fail(IndexError, "slices must have a positive step")
            start, stop, _ = _bounds(k, size)  # negative ends from the end, as Python's
            n = len(range(start, stop, step))
            if start < 0 or start >= stop or start + (n - 1) * step >= size:  # its last index, not its stop
                fail(IndexError, f"slice [{start}:{stop}] is out of bounds for axis {axis} of size {size} "
                                 f"(tensor shape {self.shape}, {self.buffer!r})")
            torch_key.append(slice(start, stop, step))
            if dim is not None:
                dims.append((dim[0], dim[1] + dim[2] * start, dim[2] * step, n))
        data = self.data[tuple(torch_key)]
        return NkiTensor(self.alloc, data, tuple(dims) if self.dims is not None else None, pdim, tuple(fixed))

    def _as_arange(self, key: tuple) -> tuple:
        """A key of slices and ints as the nl.arange expressions that address the same tile (one tile axis per
        slice, in order; an int on an on-chip tile's partition axis keeps it as one partition)."""
        key = self._keep_free_axis(key + (slice(None),) * (self.ndim - len(key)))
        on_chip = self.buffer.on_chip
        key = tuple(slice(k, k + 1) if on_chip and axis == self.pdim and isinstance(k, int) else k
                    for axis, k in enumerate(key))
        kept = sum(not isinstance(k, int) for k in key)
        out, j = [], 0
        for k, size in zip(key, self.shape, strict=True):
            if isinstance(k, int):
                out.append(k + size if k < 0 else k)
                continue
            start, stop, step = _bounds(k, size)
            out.append(IndexExpr(torch.arange(start, stop, step).view([-1 if i == j else 1 for i in range(kept)])))
            j += 1
        return tuple(out)

    def _keep_free_axis(self, key: tuple) -> tuple:
        """An on-chip tile keeps a free axis: when ints index every free axis (`t[:, i]`), the last one stays as
        a size-1 axis ([P, 1], as NKI's tiles are), so the tile is still [partition, free]."""
        free = range(self.pdim + 1, self.ndim)
        if not self.buffer.on_chip or not free or not all(
                isinstance(key[a], int) or (hasattr(key[a], "__index__") and not isinstance(key[a], slice))
                for a in free):
            return key
        last = free[-1]
        i = int(key[last])
        j = i + self.shape[last] if i < 0 else i
        return key[:last] + (slice(j, j + 1),) + key[last + 1:] if 0 <= j < self.shape[last] else key

    def __setitem__(self, key: Any, value: Any) -> None:
        dst = self[key]
        if isinstance(value, NkiTensor) and value.alloc is dst.alloc and value.box() == dst.box() \
                and type(value) is type(dst) is NkiTensor and value.data.stride() == dst.data.stride():
            return  # `t[i] += x`: Python stores the in-place result back into the place it was computed in
        if isinstance(value, LoopReduce):  # nl.loop_reduce: dst = dst <op> x
            outer = CURRENT.mask
            CURRENT.mask = value.mask
            try:
                _issue("tensor_tensor")(dst=dst, data1=dst, data2=value.x, op=value.op)
            finally:
                CURRENT.mask = outer
            return
        with _value_mask(value):
            if isinstance(value, NkiTensor):
                if _issue("assign_result")(dst, value):  # `t[...] = instr(...)`: instr wrote t, no copy
                    return
                if value.buffer.is_hbm or dst.buffer.is_hbm:
                    _issue("dma_copy")(dst=dst, src=value)
                else:
                    _issue("tensor_copy")(dst=dst, src=value)
            else:
                _issue("memset")(dst=dst, value=value)

    def broadcast_to(self, shape: Any) -> NkiTensor:
        """A view repeating this tile's size-1 axes (e.g. one partition read by all 128: stride 0)."""
        shape = tuple(shape)
        if len(shape) != self.ndim or any(s != n and s != 1 for s, n in zip(self.shape, shape, strict=True)):
            fail(ValueError, f"cannot broadcast a {self.shape} tile to {shape}: only size-1 axes repeat")
        dims = None if self.dims is None else tuple(
            (d, start, step if size == n else 0, n) for (d, start, step, size), n in zip(self.dims, shape, strict=True))
        return NkiTensor(self.alloc, self.data.expand(shape), dims, self.pdim, self.fixed)

    def reshape(self, *shape: Any, **kw: Any) -> NkiTensor:
        shape = shape or (kw.pop("shape"),)  # t.reshape(shape=(...)), as kernels also write it
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        if not self.data.is_contiguous():
            fail(ValueError, "reshape needs a contiguous tensor")
        if math.prod(shape) != self.data.numel():
            fail(ValueError, f"cannot reshape {self.shape} into {tuple(shape)}")
        return NkiTensor(self.alloc, self.data.view(*shape), None, 0 if self.buffer.is_hbm else self.pdim)

    def view(self, *shape: Any, **kw: Any) -> NkiTensor:
        """`t.view(dtype)`: the same bytes read as another dtype (the last axis scales by the size ratio);
        `t.view(shape)`: a reshape."""
        if len(shape) == 1 and not isinstance(shape[0], tuple | list | int):
            return self._bitcast(to_dtype(shape[0]))
        return self.reshape(*shape, **kw)

    def ap(self, pattern: Any, offset: int | None = None, scalar_offset: Any = None, vector_offset: Any = None,
           indirect_dim: int = 0, dtype: Any = None) -> NkiTensor:
        """AWS's raw access pattern (`t.ap([[step, num], ...], offset)`): element `offset + sum(i_k * step_k)` of
        the allocation flattened to 1-D, ignoring this view's shape and strides (`offset=None`: this view's start).
        On SBUF/PSUM the first pair walks whole partitions and the rest stay inside each partition."""
        if vector_offset is not None:
            fail(NotImplementedError, "ap: vector_offset (a per-partition dynamic offset) is not implemented")
        if isinstance(self, GatherTile):
            fail(TypeError, "ap: a tile indexed by general nl.arange expressions has no single access pattern")
        base = self.alloc.base
        if not base.is_contiguous():
            fail(ValueError, "ap needs a contiguous allocation")
        if offset is None:
            offset = self.data.storage_offset() - base.storage_offset()
        if scalar_offset is not None:  # a runtime index on axis indirect_dim of the tensor, read from SBUF
            if not isinstance(scalar_offset, NkiTensor) or scalar_offset.buffer is not SBUF or \
                    scalar_offset.dtype.is_floating_point or scalar_offset.data.numel() != 1:
                fail(TypeError, f"ap: scalar_offset must be a (1, 1) integer SBUF tile, got {scalar_offset!r}")
            run = CURRENT.run
            index = int(scalar_offset.data.reshape(-1)[0]) if run is None or run.compute else 0
            offset += index * math.prod(base.shape[indirect_dim + 1:])
        whole = self
        if dtype is not None and to_dtype(dtype) != self.dtype:  # reinterpret the allocation's bytes
            whole = NkiTensor(self.alloc, base, tuple((d, 0, 1, n) for d, n in enumerate(base.shape)),
                              self.alloc.pdim)._bitcast(to_dtype(dtype))
            whole.alloc.pdim = self.alloc.pdim
            base = whole.alloc.base
        pattern = [tuple(int(v) for v in pair) for pair in pattern]
        if not pattern or any(len(pair) != 2 or pair[0] < 0 or pair[1] < 1 for pair in pattern) or offset < 0:
            fail(ValueError, f"ap: pattern {pattern} must be [step >= 0, num >= 1] pairs and offset >= 0")
        last = offset + sum(step * (num - 1) for step, num in pattern)
        if last >= base.numel():
            fail(IndexError, f"ap: pattern {pattern} at offset {offset} reaches element {last} of a tensor of "
                             f"{base.numel()} ({tuple(base.shape)}, {self.buffer!r})")
        if self.buffer.on_chip:
            pstride, parts = base.stride(whole.alloc.pdim), base.shape[whole.alloc.pdim]
            (step, num), inner = pattern[0], offset % pstride + sum(s * (n - 1) for s, n in pattern[1:])
            if step != pstride or (offset % (pstride * parts)) // pstride + num > parts or inner >= pstride:
                fail(ValueError, f"ap: on {self.buffer.name} the first pair walks whole partitions (step {pstride}, "
                                 f"at most {parts} from the start) and the others stay within a partition: "
                                 f"pattern {pattern}, offset {offset}")
        data = torch.as_strided(base, [n for _, n in pattern], [s for s, _ in pattern], base.storage_offset() + offset)
        return NkiTensor(whole.alloc, data, None, 0)

    def _bitcast(self, dtype: torch.dtype) -> NkiTensor:
        if self.data.stride()[-1] != 1:
            fail(ValueError, f"view as {_dn(dtype)} needs a tile contiguous along its last axis")
        data = self.data.view(dtype)
        alloc = Allocation(data, self.buffer, None, initialised=True)
        if self.alloc.init is not None:  # what was written, in units of the new dtype
            flat = self.alloc.init.reshape(-1)[self.data.storage_offset():]
            init = np.lib.stride_tricks.as_strided(flat, tuple(self.data.shape), tuple(self.data.stride()))
            ratio = self.dtype.itemsize // dtype.itemsize
            init = np.repeat(init, ratio, axis=-1) if ratio >= 1 else \
                init.reshape(*init.shape[:-1], -1, dtype.itemsize // self.dtype.itemsize).all(-1)
            alloc.init = np.ascontiguousarray(init)
        return NkiTensor(alloc, data, tuple((d, 0, 1, n) for d, n in enumerate(data.shape)), self.pdim)

    # ---- operators (nl functions)
    def _op(self, name: str, other: Any, reverse: bool = False) -> NkiTensor:
        fn = OPS[name]  # nl.<name>
        return fn(other, self) if reverse else fn(self, other)

    def __add__(self, o): return self._op("add", o)
    def __radd__(self, o): return self._op("add", o, True)
    def __sub__(self, o): return self._op("subtract", o)
    def __rsub__(self, o): return self._op("subtract", o, True)
    def __mul__(self, o): return self._op("multiply", o)
    def __rmul__(self, o): return self._op("multiply", o, True)
    def __truediv__(self, o): return self._op("divide", o)
    def __rtruediv__(self, o): return self._op("divide", o, True)
    def __neg__(self): return self._op("multiply", -1.0)

    def __iadd__(self, other: Any) -> NkiTensor:
        """`psum += matmul(...)` accumulates (the Tensor engine's accumulate); elsewhere an in-place add."""
        if isinstance(other, NkiTensor) and self.buffer is PSUM and other.buffer is PSUM \
                and getattr(other.alloc, "matmul_result", False):
            with _value_mask(other):
                _issue("accumulate_psum")(self, other)
        else:
            res = self + other
            _issue("tensor_copy")(dst=self, src=res)
        return self


@dataclass(frozen=True)
class LoopReduce:
    """What `nl.loop_reduce(x, op, loop_indices)` returns: assigned to a tile, it combines x into it
    (`dst = dst <op> x`), accumulating across the loop's iterations."""

    x: NkiTensor
    op: Any
    mask: torch.Tensor | None


@contextmanager
def _value_mask(value: Any) -> Any:
    """While a masked call's result is assigned to its destination, the same mask applies."""
    m = value.alloc.mask if isinstance(value, NkiTensor) else None
    outer = CURRENT.mask
    if m is not None:
        CURRENT.mask = m if outer is None else outer & m
    try:
        yield
    finally:
        CURRENT.mask = outer


class GatherTile(NkiTensor):
    """A tile addressed by general nl.arange expressions (legacy indexing, e.g. `t[i_p, i_f2 * n + i_f1]`): its
    elements are gathered from `src` when read and scattered back when written. Indices outside the tensor are
    allowed here (`valid` marks the ones inside): the instruction that uses the tile must mask them off
    (`mask=`), as AWS's compiler requires for a tile that runs past the end of a tensor."""

    __slots__ = ("src", "idx", "valid", "indirect")

    def __init__(self, src: NkiTensor, key: tuple):
        idx, valid, self.indirect = [], None, False
        for k in key:
            if isinstance(k, IndexExpr):
                idx.append(k.values)
            elif isinstance(k, NkiTensor):  # indices computed by the kernel (an indirect DMA)
                if k.buffer is not SBUF or k.dtype.is_floating_point:
                    fail(TypeError, f"an index tile must be an integer SBUF tile, got {k!r}")
                run = CURRENT.run
                idx.append(k.data.long() if run is None or run.compute else torch.zeros(k.shape, dtype=torch.long))
                self.indirect = True
            elif isinstance(k, int):
                idx.append(torch.tensor(k))
            else:
                fail(IndexError, "mix general nl.arange expressions only with other nl.arange expressions or ints")
        for axis, size in enumerate(src.shape):
            if axis >= len(idx):
                fail(IndexError, f"index every axis of the {src.shape} tensor when indexing with general nl.arange "
                                 "expressions")
            v = idx[axis]
            inside = (v >= 0) & (v < size)
            if not bool(inside.all()):
                if isinstance(key[axis], int):
                    fail(IndexError, f"index {key[axis]} is out of bounds for axis {axis} of size {size} "
                                     f"(tensor shape {src.shape}, {src.buffer!r})")
                idx[axis] = v.clamp(0, size - 1)
                valid = inside if valid is None else valid & inside
        self.src, self.idx = src, tuple(torch.broadcast_tensors(*idx))
        self.valid = None if valid is None else valid.expand(self.idx[0].shape)
        super().__init__(src.alloc, src.data[self.idx], None, 0)

    @property
    def data(self) -> torch.Tensor:
        return self.src.data[self.idx]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        pass

    def selected(self, sel: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
        """The source positions of the selected elements inside the tensor (None: all of them)."""
        keep = self.valid if sel is None else (sel if self.valid is None else sel & self.valid)
        return None if keep is None else tuple(i[keep] for i in self.idx)

    def write(self, value: torch.Tensor, sel: torch.Tensor | None = None) -> None:
        value = value.reshape(self.idx[0].shape)
        keep = self.valid if sel is None else (sel if self.valid is None else sel & self.valid)
        if keep is None:
            self.src.data.index_put_(self.idx, value)
        else:
            self.src.data.index_put_(tuple(i[keep] for i in self.idx), value[keep])


def mask_for(t: NkiTensor) -> torch.Tensor | None:
    """The current instruction's `mask=` as a bool tensor of `t`'s shape (None: no mask). A mask over the
    instruction's [P, F...] iteration space applies elementwise to a tile of that shape; to a tile of the same
    partitions and another free size (a [P, 1] operand or reduction result) it applies per partition."""
    m = CURRENT.mask
    if m is None:
        return None
    shape = t.shape
    if m.dim() == 0 or (m.dim() == len(shape) and all(a in (1, b) for a, b in zip(m.shape, shape, strict=True))):
        return m.expand(shape)
    p, free = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
    if m.shape[0] not in (1, p):
        return None  # a different iteration space (a matmul's stationary operand): the whole tile
    m2 = m.reshape(m.shape[0], -1)
    if m2.shape[1] not in (1, free):
        m2 = m2.any(1, keepdim=True)
    return m2.expand(p, free).reshape(shape)


def masked_off() -> bool:
    """Whether the instruction being issued is masked off entirely (`mask=False`): the compiler drops it."""
    m = CURRENT.mask
    return m is not None and not bool(m.any())


def _mask_tensor(mask: Any) -> torch.Tensor:
    if isinstance(mask, IndexExpr):
        return mask.values.bool()
    if isinstance(mask, NkiTensor):
        fail(TypeError, "mask= is a compile-time predicate of nl.arange expressions (or a Python bool), not a "
                        "tile: select on tile values with nl.where / nisa.select")
    if isinstance(mask, bool | np.bool_ | int):
        return torch.tensor(bool(mask))
    fail(TypeError, f"mask= must be an nl.arange predicate or a bool, got {type(mask).__name__}")
    raise AssertionError  # fail raised


def accept_masks(namespace: dict) -> None:
    """Wrap the public functions of a module to take the legacy `mask=` argument: while the function runs the
    instructions it issues compute, read and write only the mask's elements (CURRENT.mask). A tile returned by a
    masked call keeps its mask, so `dst[...] = instr(..., mask=m)` writes only those elements of dst (the compiler
    makes dst the instruction's destination)."""
    import functools
    import types

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def masked(*args: Any, **kwargs: Any) -> Any:
            mask = kwargs.pop("mask", None)
            if mask is None:
                return fn(*args, **kwargs)
            outer = CURRENT.mask
            m = _mask_tensor(mask)
            CURRENT.mask = m if outer is None else outer & m
            try:
                result = fn(*args, **kwargs)
            finally:
                CURRENT.mask = outer
            if isinstance(result, NkiTensor) and result.alloc.mask is None:  # unless the call set it (nc_transpose)
                result.alloc.mask = m
            return result
        return masked

    for name, obj in list(namespace.items()):
        if isinstance(obj, types.FunctionType) and not name.startswith("_") and obj.__module__ == namespace["__name__"]:
            namespace[name] = wrap(obj)
