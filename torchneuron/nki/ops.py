"""NKI's operators (`nl.add`, `nl.exp`, `nl.max`, ...): each is both a function on tiles (`nl.exp(t)`) and an
`op=` argument of `nki.isa` instructions. Engines compute in float32 (S12); `fn` is that float32 computation.

Activation functions are computed exactly in float32 except where AWS documents the approximation the Scalar
engine's tables implement (`gelu_apprx_tanh`, `gelu_apprx_sigmoid` are those formulas); the hardware's table
interpolation error for the others is not modelled (docs/nki.md)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# How an op runs on tiles: nki.language's `apply_op`. nki.language builds on this table, so it hands the function over
# when it is imported (`provide`) instead of this module importing it.
_APPLY: Callable[..., Any] | None = None


def provide(apply: Callable[..., Any]) -> None:
    global _APPLY
    _APPLY = apply


@dataclass(frozen=True, eq=False)
class Op:
    """One operator. kind: "arith" (binary), "bitvec" (binary on integer bits), "cmp" (binary, 0/1 result),
    "act" (unary activation function), "reduce" (a reduction usable also as its binary form)."""

    name: str
    kind: str
    fn: Callable[..., torch.Tensor]
    reduce: Callable[..., torch.Tensor] | None = None  # over free axes, when the op reduces

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _APPLY is None:
            raise RuntimeError(f"nl.{self.name}: import torchneuron.nki.language (nki.language) first")
        return _APPLY(self, *args, **kwargs)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_dx(x: torch.Tensor) -> torch.Tensor:
    """d/dx x Phi(x) = Phi(x) + x phi(x)."""
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _gelu_sigmoid_dx(x: torch.Tensor) -> torch.Tensor:
    """d/dx x sigmoid(1.702 x)."""
    s = torch.sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1 - s)


def _silu_dx(x: torch.Tensor) -> torch.Tensor:
    """d/dx x sigmoid(x)."""
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _sum(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return x.sum(dims)


BINARY = {
    "add": ("arith", torch.add, _sum),
    "subtract": ("arith", torch.sub, None),
    "multiply": ("arith", torch.mul, lambda x, d: x.prod(d[0]) if len(d) == 1 else x.flatten(d[0]).prod(d[0])),
    "divide": ("arith", torch.div, None),
    "maximum": ("arith", torch.maximum, lambda x, d: x.amax(d)),
    "minimum": ("arith", torch.minimum, lambda x, d: x.amin(d)),
    "max": ("arith", torch.maximum, lambda x, d: x.amax(d)),
    "min": ("arith", torch.minimum, lambda x, d: x.amin(d)),
    "power": ("arith", torch.pow, None),
    "mod": ("arith", torch.remainder, None),
    "fmod": ("arith", torch.fmod, None),
    # the signed input of larger / smaller magnitude, y on a tie (NeuronCore-v4 and newer)
    "abs_max": ("arith", lambda a, b: torch.where(a.abs() > b.abs(), a, b), None),
    "abs_min": ("arith", lambda a, b: torch.where(a.abs() < b.abs(), a, b), None),
    "equal": ("cmp", lambda a, b: (a == b).float(), None),
    "not_equal": ("cmp", lambda a, b: (a != b).float(), None),
    "greater": ("cmp", lambda a, b: (a > b).float(), None),
    "greater_equal": ("cmp", lambda a, b: (a >= b).float(), None),
    "less": ("cmp", lambda a, b: (a < b).float(), None),
    "less_equal": ("cmp", lambda a, b: (a <= b).float(), None),
    "logical_and": ("cmp", lambda a, b: ((a != 0) & (b != 0)).float(), lambda x, d: (x != 0).float().amin(d)),
    "logical_or": ("cmp", lambda a, b: ((a != 0) | (b != 0)).float(), lambda x, d: (x != 0).float().amax(d)),
    "logical_xor": ("cmp", lambda a, b: ((a != 0) ^ (b != 0)).float(), None),
    "bitwise_and": ("bitvec", torch.bitwise_and, None),
    "bitwise_or": ("bitvec", torch.bitwise_or, None),
    "bitwise_xor": ("bitvec", torch.bitwise_xor, None),
    "left_shift": ("bitvec", torch.bitwise_left_shift, None),
    "right_shift": ("bitvec", torch.bitwise_right_shift, None),
}

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "copy": lambda x: x,
    "identity": lambda x: x,
    "exp": torch.exp,
    "log": torch.log,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "gelu": lambda x: torch.nn.functional.gelu(x),
    "gelu_apprx_tanh": _gelu_tanh,
    "gelu_apprx_sigmoid": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": torch.nn.functional.silu,
    "mish": torch.nn.functional.mish,
    "softplus": torch.nn.functional.softplus,
    "rsqrt": torch.rsqrt,
    "sqrt": torch.sqrt,
    "square": torch.square,
    "reciprocal": torch.reciprocal,
    "abs": torch.abs,
    "negative": torch.neg,
    "sign": torch.sign,
    "sin": torch.sin,
    "cos": torch.cos,
    "arctan": torch.atan,
    "erf": torch.erf,
    "erf_dx": lambda x: 2 / math.sqrt(math.pi) * torch.exp(-x * x),
    "gelu_dx": _gelu_dx,
    "gelu_apprx_sigmoid_dx": _gelu_sigmoid_dx,
    "silu_dx": _silu_dx,
    "tan": torch.tan,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "trunc": torch.trunc,
}

OPS: dict[str, Op] = {}
for _name, (_kind, _fn, _red) in BINARY.items():
    OPS[_name] = Op(_name, _kind, _fn, _red)
for _name, _fn in ACTIVATIONS.items():
    OPS[_name] = Op(_name, "act", _fn)
OPS["sum"] = Op("sum", "reduce", torch.add, _sum)
OPS["mean"] = Op("mean", "reduce", torch.add, lambda x, d: x.mean(d))
OPS["prod"] = Op("prod", "reduce", torch.mul, BINARY["multiply"][2])
OPS["bypass"] = Op("bypass", "arith", lambda a, b: a)
# The ALU's unary operators (AWS's operator table, nki-aluop): `nisa.tensor_scalar(op0=nl.rsqrt, operand0=0)`, the
# operand unused. nl.invert is the bitvec one (bitwise NOT); the others are also activation functions.
OPS["invert"] = Op("invert", "bitvec", lambda a, b: torch.bitwise_not(a))
ALU_UNARY = {"invert": OPS["invert"], **{name: Op(name, "arith", lambda a, b, f=ACTIVATIONS[name]: f(a))
                                         for name in ("abs", "square", "relu", "rsqrt", "reciprocal")}}


def as_op(op: Any) -> Any:
    """An Op from an Op or a NumPy ufunc of the same name (`np.add`, `np.multiply`: what earlier kernels pass)."""
    if isinstance(op, Op):
        return op
    name = getattr(op, "__name__", None)
    if type(op).__name__ == "ufunc" or getattr(op, "__module__", None) == "numpy":  # np.add, np.max, np.mod
        name = _NUMPY_NAMES.get(name, name)
        return OPS.get(name, op)
    return op


# NumPy's names that differ from NKI's
_NUMPY_NAMES = {"amax": "max", "amin": "min", "remainder": "mod", "true_divide": "divide", "sum": "add",
                "prod": "multiply", "negative": "negative"}
