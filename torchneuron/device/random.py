"""RNG of `torch.neuron`, mirroring `torch.cuda.random`: one default generator per neuron device."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import _C
from .module import _checked, _device_t, device_count


def default_generator(device: _device_t = None) -> torch.Generator:
    return _C._default_generator(_checked(device))


def get_rng_state(device: _device_t = "neuron") -> torch.Tensor:
    return default_generator(device).get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state(new_state: torch.Tensor, device: _device_t = "neuron") -> None:
    default_generator(device).set_state(new_state.clone())


def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    """Seed the current neuron device's generator."""
    default_generator(None).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        default_generator(i).manual_seed(int(seed))


def seed() -> None:
    """Seed the current device's generator with a non-deterministic random number."""
    default_generator(None).seed()


def seed_all() -> None:
    s = default_generator(None).seed()
    for i in range(device_count()):
        default_generator(i).manual_seed(s)


def initial_seed() -> int:
    return default_generator(None).initial_seed()
