"""The configuration of the modelled machine and the device policies, read from the environment once.

| variable | default | meaning |
|---|---|---|
| TORCHNEURON_INSTANCE | trn2.3xlarge | modelled instance type (see chips.INSTANCES) |
| NEURON_LOGICAL_NC_CONFIG | chip default (2 on trn2/trn3) | physical cores per logical core (AWS's own variable) |
| NEURON_RT_VISIBLE_CORES | all | logical cores this process sees, e.g. "0-3" or "1,3" (AWS's own variable) |
| TORCHNEURON_MEMORY_LIMIT | the core's HBM share | per-core capacity override, e.g. 512MiB, 2GB, 1048576 |
| TORCHNEURON_DTYPE_POLICY | trainium | trainium: fp64 computes in fp32, int64 range warnings; host: full precision |
| TORCHNEURON_FALLBACK | warn | host-fallback ops: warn (once per op), silent, error |
| LOCAL_RANK | unset | set by torchrun: the process starts with `neuron:LOCAL_RANK` as its current device |

`load` raises ConfigError for an invalid value; the device module turns that into an unusable device (the error is
raised at the first use of `neuron`), never into a failing `import torch`.

AWS TorchNeuron's own names for the same settings are honoured too (ALIASES, below).
"""
from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from .chips import CHIPS, DEFAULT_INSTANCE, INSTANCES, Chip, Instance

DTYPE_POLICIES = ("trainium", "host")
FALLBACK_POLICIES = ("warn", "silent", "error")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


class ConfigError(ValueError):
    """A configuration variable holds a value the modelled machine cannot have."""


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read a size from {text!r}: use e.g. 512MiB, 2GB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_core_list(text: str, available: int) -> list[int]:
    cores: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ConfigError(f"NEURON_RT_VISIBLE_CORES={text!r}: expected a list like '0-3' or '0,2'")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    repeated = sorted({c for c in cores if cores.count(c) > 1})
    if repeated:  # one physical core would appear as two devices, each claiming its whole memory
        raise ConfigError(f"NEURON_RT_VISIBLE_CORES={text!r} names core(s) {repeated} more than once; "
                          "list each logical core once")
    bad = [c for c in cores if c >= available]
    if bad or not cores:
        raise ConfigError(f"NEURON_RT_VISIBLE_CORES={text!r} names cores {bad or '(none)'}, but the modelled "
                          f"machine has logical cores 0-{available - 1}")
    return cores


@dataclass(frozen=True)
class Config:
    instance: Instance
    chip: Chip
    lnc: int
    visible_cores: tuple[int, ...]  # global logical-core ids, one per torch device index
    core_capacity: int  # bytes per logical core (after TORCHNEURON_MEMORY_LIMIT)
    memory_limit_override: bool
    dtype_policy: str
    fallback_policy: str
    local_rank: int | None = None

    @property
    def device_count(self) -> int:
        return len(self.visible_cores)

    @property
    def cores_per_chip(self) -> int:
        return self.chip.logical_cores(self.lnc)

    @property
    def local_rank_error(self) -> str | None:
        """torchrun's LOCAL_RANK must name a visible core. Raised when the rank first uses the device, so that a
        job with more ranks than cores that never touches `neuron` (a CPU-only torchrun job) is unaffected."""
        if self.local_rank is not None and self.local_rank >= self.device_count:
            return (f"LOCAL_RANK={self.local_rank} but this process sees only {self.device_count} neuron core(s): "
                    "launch at most one process per visible logical core (torchrun --nproc-per-node)")
        return None


def _core_count(text: str) -> str:
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(f"NEURON_RT_NUM_CORES={text!r}: expected a positive core count")
    return f"0-{int(text) - 1}"


def _disable_fallback(text: str) -> str:
    value = {"1": "error", "true": "error", "0": "eager", "false": "eager"}.get(text.strip().lower())
    if value is None:
        raise ConfigError(f"TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION={text!r}: choose 1 (raise) or 0 (run eagerly)")
    return value


class Alias(NamedTuple):
    """An AWS TorchNeuron variable that means the same as one of ours; `translate` maps its value to ours."""

    aws: str
    ours: str
    translate: Callable[[str], str] = str.strip


# AWS's environment variables honoured as aliases (their docs: "TorchNeuron environment variables"). Ours wins
# when both are set (a disagreement warns once). Variables whose meaning differs are deliberately absent.
ALIASES = (
    Alias("TORCH_NEURONX_DEBUG_DIR", "TORCHNEURON_DEBUG_DIR"),
    Alias("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCHNEURON_CACHE_DIR"),
    Alias("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "TORCHNEURON_COMPILE_FALLBACK", _disable_fallback),
    Alias("NEURON_RT_NUM_CORES", "NEURON_RT_VISIBLE_CORES", _core_count),  # n cores: 0..n-1
)
_WARNED: set[str] = set()


def with_aliases(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with each of our variables that is unset filled in from its AWS alias (see ALIASES)."""
    out = dict(env)
    for alias in ALIASES:
        if alias.aws not in env:
            continue
        theirs = alias.translate(env[alias.aws])
        if alias.ours not in env:
            out[alias.ours] = theirs
        elif env[alias.ours].strip() != theirs and alias.aws not in _WARNED:
            _WARNED.add(alias.aws)
            warnings.warn(f"{alias.ours}={env[alias.ours]!r} and AWS's {alias.aws}={env[alias.aws]!r} disagree: "
                          f"using {alias.ours}", RuntimeWarning, stacklevel=2)
    return out


def setting(name: str, default: str = "", env: Mapping[str, str] | None = None) -> str:
    """The value of one of our variables, or of its AWS alias when ours is unset (see ALIASES)."""
    return with_aliases(os.environ if env is None else env).get(name, default)


def _choice(env: dict, name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env.get(name, default).strip().lower() or default
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: choose one of {', '.join(choices)}")
    return value


def load(env: dict | None = None) -> Config:
    env = with_aliases(os.environ if env is None else env)
    name = env.get("TORCHNEURON_INSTANCE", DEFAULT_INSTANCE).strip() or DEFAULT_INSTANCE
    if name not in INSTANCES:
        raise ConfigError(f"TORCHNEURON_INSTANCE={name!r} is not a modelled instance: {', '.join(INSTANCES)}")
    inst = INSTANCES[name]
    chip = CHIPS[inst.chip]
    lnc_text = env.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    lnc = int(lnc_text) if lnc_text.isdigit() else chip.default_lnc
    if lnc_text and (not lnc_text.isdigit() or lnc not in chip.lnc_options):
        raise ConfigError(f"NEURON_LOGICAL_NC_CONFIG={lnc_text!r} is not valid on {chip.name}: "
                          f"choose {' or '.join(map(str, chip.lnc_options))}")
    total = chip.logical_cores(lnc) * inst.chips
    visible_text = env.get("NEURON_RT_VISIBLE_CORES", "").strip()
    visible = parse_core_list(visible_text, total) if visible_text else list(range(total))
    if len(visible) > 127:
        raise ConfigError(f"{len(visible)} visible cores exceed PyTorch's device-index limit of 127: "
                          "restrict them with NEURON_RT_VISIBLE_CORES")
    limit_text = env.get("TORCHNEURON_MEMORY_LIMIT", "").strip()
    capacity = parse_bytes(limit_text) if limit_text else chip.core_hbm(lnc)
    rank_text = env.get("LOCAL_RANK", "").strip()
    local_rank = int(rank_text) if rank_text.isdigit() else None
    return Config(
        instance=inst, chip=chip, lnc=lnc, visible_cores=tuple(visible), core_capacity=capacity,
        memory_limit_override=bool(limit_text),
        dtype_policy=_choice(env, "TORCHNEURON_DTYPE_POLICY", "trainium", DTYPE_POLICIES),
        fallback_policy=_choice(env, "TORCHNEURON_FALLBACK", "warn", FALLBACK_POLICIES),
        local_rank=local_rank,
    )
