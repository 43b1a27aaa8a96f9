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
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

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


def _choice(env: dict, name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env.get(name, default).strip().lower() or default
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: choose one of {', '.join(choices)}")
    return value


def load(env: dict | None = None) -> Config:
    env = os.environ if env is None else env
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
    if local_rank is not None and local_rank >= len(visible):
        raise ConfigError(f"LOCAL_RANK={local_rank} but this process sees only {len(visible)} neuron core(s): "
                          "launch at most one process per visible logical core (torchrun --nproc-per-node)")
    return Config(
        instance=inst, chip=chip, lnc=lnc, visible_cores=tuple(visible), core_capacity=capacity,
        memory_limit_override=bool(limit_text),
        dtype_policy=_choice(env, "TORCHNEURON_DTYPE_POLICY", "trainium", DTYPE_POLICIES),
        fallback_policy=_choice(env, "TORCHNEURON_FALLBACK", "warn", FALLBACK_POLICIES),
        local_rank=local_rank,
    )
