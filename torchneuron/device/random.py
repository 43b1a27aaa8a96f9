"""RNG of `torch.neuron`, mirroring `torch.cuda.random`: one default generator per neuron device."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from .. import _C
from .module import _checked, _count, _device_t, device_count

F = TypeVar("F", bound=Callable)


def _eager(fn: F) -> F:
    """Run under torch.compile as a graph break, the way Dynamo skips torch.cuda's RNG functions; inlined, they
    would build the state tensor as a fake tensor (and fail under no_dispatch(), as in freeze_rng_state).
    Dynamo is not imported for this: nothing can be compiling before it is."""
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        return fn(*args, **kwargs) if dynamo is None else dynamo.disable(fn)(*args, **kwargs)
    return inner  # type: ignore[return-value]


def default_generator(device: _device_t = None) -> torch.Generator:
    return _C._default_generator(_checked(device))


@_eager
def get_rng_state(device: _device_t = "neuron") -> torch.Tensor:
    return default_generator(device).get_state()


@_eager
def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


@_eager
def set_rng_state(new_state: torch.Tensor, device: _device_t = "neuron") -> None:
    default_generator(device).set_state(new_state.clone())


@_eager
def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


@_eager
def manual_seed(seed: int) -> None:
    """Seed the current neuron device's generator."""
    default_generator(None).manual_seed(int(seed))


@_eager
def manual_seed_all(seed: int) -> None:
    """Called by torch.manual_seed and torch.seed in every program: it neither initialises the device nor fails
    when it is unusable (as torch.cuda's, which is queued until CUDA initialises)."""
    for i in range(_count()):
        _C._default_generator(i).manual_seed(int(seed))


@_eager
def seed() -> None:
    """Seed the current device's generator with a non-deterministic random number."""
    default_generator(None).seed()


@_eager
def seed_all() -> None:
    s = default_generator(None).seed()
    for i in range(device_count()):
        default_generator(i).manual_seed(s)


@_eager
def initial_seed() -> int:
    return default_generator(None).initial_seed()
