"""RNG of `torch.neuron`, mirroring `torch.cuda.random`: one default generator per neuron device."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from .. import _C
from ..runtime import patches
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


def _register_rng_state_ops(done: patches.Applied) -> None:
    """AOTAutograd's RNG functionalisation (a random op recomputed in the backward, as under activation
    checkpointing) saves the device RNG state before the forward's draw and replays it for the backward's through
    two higher-order ops whose device table lists cuda/cpu/hpu/xpu only. Add neuron, handled as CUDA is: its
    state is the [seed, offset] pair, so replaying it redraws the same numbers. Both modules are loaded by
    `import torch` already."""
    from torch._C import DispatchKey
    from torch._higher_order_ops.utils import registered_hop_fake_fns
    from torch._prims import rng_prims

    def save(op, *args, **kwargs):
        return get_rng_state(), op(*args, **kwargs)

    def replay(rng_state, op, *args, **kwargs):
        current = get_rng_state()
        set_rng_state(rng_state.cpu())
        try:
            return op(*args, **kwargs)
        finally:
            set_rng_state(current)

    for hop, ours, skip in ((rng_prims.run_and_save_rng_state, save, 1), (rng_prims.run_with_rng_state, replay, 2)):
        theirs = hop.py_kernels[DispatchKey.BackendSelect]

        def select(*args, _ours=ours, _theirs=theirs, _skip=skip, **kwargs):
            on_neuron = rng_prims.get_device(args[_skip:], kwargs) == "neuron"
            return (_ours if on_neuron else _theirs)(*args, **kwargs)

        done.replace_item(hop.py_kernels, DispatchKey.BackendSelect, select)
        hop._dispatch_cache.clear()
        if hop is rng_prims.run_and_save_rng_state:  # its fake kernel calls the device table directly
            done.replace_item(registered_hop_fake_fns, hop, select)


def _clear_rng_hop_caches() -> None:
    from torch._prims import rng_prims

    for hop in (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state):
        hop._dispatch_cache.clear()


RNG_STATE_OPS = patches.declare(
    "rng-state-ops-on-neuron", "torch._prims.rng_prims.run_and_save_rng_state / run_with_rng_state "
    "(BackendSelect kernels, registered fake kernel)",
    "AOTAutograd's RNG functionalisation (recomputed dropout) saves and replays the neuron generator's state",
    "tests/test_rng.py::test_compiled_checkpoint_recomputes_the_same_dropout", _register_rng_state_ops,
    undo=_clear_rng_hop_caches)
patches.apply(RNG_STATE_OPS)
