"""The one configuration of torchneuron: every environment variable it reads, read and validated here only.

VARIABLES lists them (the README's configuration table is rendered from it: `table()`); AWS TorchNeuron's names
for the same settings are honoured too (ALIASES). `load` parses an environment into a Config and raises
ConfigError, naming the variable and its valid values, for an invalid one. The process's Config (`current()`) is
read once, when the device registers: an invalid value leaves the device unusable and is raised at the first use
of `neuron`, never by `import torch`. Variables read at use (`Variable.at_use`: the compiler's, distributed's,
compat's) are read again when their value changes, so that a script or test may set them before that use. Writes
to the environment (for other libraries) go through `scoped_env` / `default_env`: nothing else touches os.environ.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from .chips import CHIPS, DEFAULT_INSTANCE, INSTANCES, Chip, Instance

DTYPE_POLICIES = ("trainium", "host")
FALLBACK_POLICIES = ("warn", "silent", "error")
COMPILE_FALLBACKS = ("error", "eager")
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


# NEURON_PLATFORM_TARGET_OVERRIDE's values (AWS's nki.jit reference) -> the modelled chip
NKI_PLATFORMS = {"trn1": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2", "trn3": "trn3", "gen4": "trn3"}


class Variable(NamedTuple):
    """One environment variable torchneuron reads: a row of the README's configuration table."""

    name: str
    default: str
    meaning: str
    at_use: bool = False  # read again when it changes (else once, when the device registers)


VARIABLES = (
    Variable("TORCHNEURON_INSTANCE", f"`{DEFAULT_INSTANCE}`", f"modelled instance: {', '.join(INSTANCES)}"),
    Variable("NEURON_LOGICAL_NC_CONFIG", "2 on trn2/trn3", "physical NeuronCores per logical core (AWS's "
             "variable): trn2 LNC=2 gives 4 cores of 24 GiB per chip"),
    Variable("NEURON_RT_VISIBLE_CORES", "all", "logical cores this process sees, e.g. `0-3`, `1,3` (AWS's "
             "variable; each core at most once)"),
    Variable("TORCHNEURON_MEMORY_LIMIT", "the core's HBM share", "per-core capacity override for tests, e.g. "
             "`512MiB`, `2GB`, a byte count"),
    Variable("TORCHNEURON_DTYPE_POLICY", "`trainium`", "`trainium`: float64 values carry float32 precision, int64 "
             "outside int32 warns; `host`: full precision"),
    Variable("TORCHNEURON_FALLBACK", "`warn`", "ops outside the device's native set: `warn` once per op, `silent`, "
             "or `error`"),
    Variable("LOCAL_RANK", "unset", "set by torchrun: the process starts on `neuron:LOCAL_RANK`"),
    Variable("TORCHNEURON_COMPILE_FALLBACK", "`error`", "a graph that fails to compile: `error` (names graph and "
             "node) or `eager` (runs it eagerly, reported)", at_use=True),
    Variable("TORCHNEURON_CACHE_DIR", "`$XDG_CACHE_HOME/torchneuron`", "on-disk compile cache (private to the "
             "user)", at_use=True),
    Variable("XDG_CACHE_HOME", "`~/.cache`", "parent of the compile cache when `TORCHNEURON_CACHE_DIR` is unset",
             at_use=True),
    Variable("TORCHINDUCTOR_CACHE_DIR", "unset", "Inductor's: when set, the neuron compiler's kernels build there "
             "instead of under the compile cache", at_use=True),
    Variable("TORCHNEURON_DEBUG_DIR", "unset", "keep per-graph compiler artifacts here", at_use=True),
    Variable("NEURON_PLATFORM_TARGET_OVERRIDE", "unset", "AWS's variable: the chip NKI kernels without an explicit "
             f"target model ({', '.join(f'`{k}`' for k in NKI_PLATFORMS)}; default: the instance's)", at_use=True),
    Variable("TORCHNEURON_DIST_CHECKS", "`1`", "`0`: skip the per-collective agreement check of the `neuron` "
             "process group (docs/distributed.md)", at_use=True),
    Variable("TORCHNEURON_CUDA_COMPAT", "`0`", "`1`: run unmodified CUDA code on `neuron` (see docs/compat.md)"),
    Variable("TORCHNEURON_PORTING_REPORT", "unset", "with compat mode: write the porting report at exit to "
             "`path.json`, `path.md` or `-` (stdout)"),
    Variable("TORCHNEURON_LAUNCH_BLOCKING", "`0`", "`1`: every op runs to completion before its launch returns (like "
             "`CUDA_LAUNCH_BLOCKING`), so an error is raised by the op that caused it"),
    Variable("TORCHNEURON_EXIT_TIMEOUT", "`60`", "seconds the exit-time drain waits for queued work; then it names "
             "the busy streams and the process ends with status 1 (see docs/device.md, exit)"),
    Variable("TORCHNEURON_STREAM_CHECK", "`0`", "`1`: report any tensor used on two streams without an ordering edge "
             "(event, `wait_stream`, synchronize), with both Python stacks (see docs/device.md, stream checker)"),
    Variable("TORCHNEURON_EAGER_FUSION", "`1`", "`0`: never fuse queued elementwise runs into one kernel (adaptive "
             "eager fusion; also off under `torch.use_deterministic_algorithms(True)`)"),
    Variable("TORCHNEURON_FUSION_COMPILE_BUDGET", "`600`", "seconds eager fusion may spend compiling kernels in a "
             "process; past it, groups not yet compiled run unfused (counted in the porting report)"),
    Variable("TORCH_DEVICE_BACKEND_AUTOLOAD", "`1`", "PyTorch's switch (read by torch): `0` keeps `import torch` "
             "from loading torchneuron"),
)
_NAMES = {v.name for v in VARIABLES}


def _core_count(text: str) -> str:
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(f"NEURON_RT_NUM_CORES={text!r}: expected a positive core count")
    return f"0-{int(text) - 1}"


def _disable_fallback(text: str) -> str:
    value = {"1": "error", "true": "error", "0": "eager", "false": "eager"}.get(text.strip().lower())
    if value is None:
        raise ConfigError(f"TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION={text!r}: choose 1 (raise) or 0 (run eagerly)")
    return value


def _inverse_flag(name: str, text: str) -> str:
    value = {"1": "0", "true": "0", "0": "1", "false": "1"}.get(text.strip().lower())
    if value is None:
        raise ConfigError(f"{name}={text!r}: choose 1 or 0")
    return value


class Alias(NamedTuple):
    """An AWS TorchNeuron variable that means the same as one of ours; `translate` maps its value to ours."""

    aws: str
    ours: str
    translate: Callable[[str], str] = str.strip
    note: str = ""  # how its values map onto ours, when not the same value


# AWS's environment variables honoured as aliases (their docs: "TorchNeuron environment variables"). Ours wins
# when both are set (a disagreement warns once). Variables whose meaning differs are deliberately absent.
ALIASES = (
    Alias("TORCH_NEURONX_DEBUG_DIR", "TORCHNEURON_DEBUG_DIR"),
    Alias("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCHNEURON_CACHE_DIR"),
    Alias("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "TORCHNEURON_COMPILE_FALLBACK", _disable_fallback,
          "1=`error`, 0=`eager`"),
    Alias("TORCH_NEURONX_ENABLE_ASYNC_NRT", "TORCHNEURON_LAUNCH_BLOCKING", lambda t: _inverse_flag(
        "TORCH_NEURONX_ENABLE_ASYNC_NRT", t), "1=`0`, 0=`1`"),
    Alias("NEURON_RT_NUM_CORES", "NEURON_RT_VISIBLE_CORES", _core_count, "n means `0-(n-1)`"),  # n cores: 0..n-1
)
_WARNED: set[str] = set()
_AT_USE = tuple(v.name for v in VARIABLES if v.at_use) + tuple(
    a.aws for a in ALIASES if any(v.at_use and v.name == a.ours for v in VARIABLES))


def table() -> str:
    """The README's configuration table (a test keeps README.md equal to it)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for v in VARIABLES:
        aws = "".join(f" (AWS: `{a.aws}`{', ' + a.note if a.note else ''})" for a in ALIASES if a.ours == v.name)
        rows.append(f"| `{v.name}`{aws} | {v.default} | {v.meaning} |")
    return "\n".join(rows)


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


def _get(env: Mapping[str, str], name: str) -> str:
    assert name in _NAMES, f"{name} is read but not listed in VARIABLES"
    return env.get(name, "").strip()


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    value = _get(env, name).lower() or default
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: choose one of {', '.join(choices)}")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = _get(env, name).lower()
    if value and value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ConfigError(f"{name}={value!r}: choose one of 1, 0 (or true, false, yes, no, on, off)")
    return value in ("1", "true", "yes", "on") if value else default


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    text = _get(env, name)
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={text!r}: expected a positive number of seconds")
    return value


@dataclass(frozen=True)
class Config:
    # the machine and the device policies: read once, when the device registers
    instance: Instance
    chip: Chip
    lnc: int
    visible_cores: tuple[int, ...]  # global logical-core ids, one per torch device index
    core_capacity: int  # bytes per logical core (after TORCHNEURON_MEMORY_LIMIT)
    memory_limit_override: bool
    dtype_policy: str
    fallback_policy: str
    local_rank: int | None = None
    cuda_compat: bool = False  # TORCHNEURON_CUDA_COMPAT (applied by autoload)
    porting_report: str | None = None  # TORCHNEURON_PORTING_REPORT
    launch_blocking: bool = False  # TORCHNEURON_LAUNCH_BLOCKING
    stream_check: bool = False  # TORCHNEURON_STREAM_CHECK
    exit_timeout: float = 60.0  # TORCHNEURON_EXIT_TIMEOUT, seconds
    eager_fusion: bool = True  # TORCHNEURON_EAGER_FUSION
    fusion_compile_budget: float = 600.0  # TORCHNEURON_FUSION_COMPILE_BUDGET, seconds of fusion compiling per process
    # the tools' settings (Variable.at_use): read again when their variable changes
    compile_fallback: str = "error"
    cache_dir: Path = Path("~/.cache/torchneuron")
    inductor_cache_dir: str | None = None  # the user's TORCHINDUCTOR_CACHE_DIR (or the one Inductor set)
    debug_dir: Path | None = None
    dist_checks: bool = True
    nki_platform: str | None = None  # NEURON_PLATFORM_TARGET_OVERRIDE, as a chip name

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


def _at_use_fields(env: Mapping[str, str]) -> dict:
    """The Config fields of the at-use variables (`env` has its aliases applied)."""
    cache, debug = _get(env, "TORCHNEURON_CACHE_DIR"), _get(env, "TORCHNEURON_DEBUG_DIR")
    platform = _get(env, "NEURON_PLATFORM_TARGET_OVERRIDE").lower()
    if platform and platform not in NKI_PLATFORMS:
        raise ConfigError(f"NEURON_PLATFORM_TARGET_OVERRIDE={platform!r}: choose one of {', '.join(NKI_PLATFORMS)} "
                          "(inf2 is not modelled)")
    return dict(
        compile_fallback=_choice(env, "TORCHNEURON_COMPILE_FALLBACK", "error", COMPILE_FALLBACKS),
        cache_dir=Path(cache).expanduser() if cache else
        Path(_get(env, "XDG_CACHE_HOME") or Path.home() / ".cache") / "torchneuron",
        inductor_cache_dir=_get(env, "TORCHINDUCTOR_CACHE_DIR") or None,
        debug_dir=Path(debug) if debug else None,
        dist_checks=_flag(env, "TORCHNEURON_DIST_CHECKS", True),
        nki_platform=NKI_PLATFORMS[platform] if platform else None,
    )


def load(env: Mapping[str, str] | None = None) -> Config:
    """The configuration `env` (default: this process's environment) describes; ConfigError if it is invalid."""
    env = with_aliases(os.environ if env is None else env)
    name = _get(env, "TORCHNEURON_INSTANCE") or DEFAULT_INSTANCE
    if name not in INSTANCES:
        raise ConfigError(f"TORCHNEURON_INSTANCE={name!r} is not a modelled instance: {', '.join(INSTANCES)}")
    inst = INSTANCES[name]
    chip = CHIPS[inst.chip]
    lnc_text = _get(env, "NEURON_LOGICAL_NC_CONFIG")
    lnc = int(lnc_text) if lnc_text.isdigit() else chip.default_lnc
    if lnc_text and (not lnc_text.isdigit() or lnc not in chip.lnc_options):
        raise ConfigError(f"NEURON_LOGICAL_NC_CONFIG={lnc_text!r} is not valid on {chip.name}: "
                          f"choose {' or '.join(map(str, chip.lnc_options))}")
    total = chip.logical_cores(lnc) * inst.chips
    visible_text = _get(env, "NEURON_RT_VISIBLE_CORES")
    visible = parse_core_list(visible_text, total) if visible_text else list(range(total))
    if len(visible) > 127:
        raise ConfigError(f"{len(visible)} visible cores exceed PyTorch's device-index limit of 127: "
                          "restrict them with NEURON_RT_VISIBLE_CORES")
    limit_text = _get(env, "TORCHNEURON_MEMORY_LIMIT")
    capacity = parse_bytes(limit_text) if limit_text else chip.core_hbm(lnc)
    rank_text = _get(env, "LOCAL_RANK")
    return Config(
        instance=inst, chip=chip, lnc=lnc, visible_cores=tuple(visible), core_capacity=capacity,
        memory_limit_override=bool(limit_text),
        dtype_policy=_choice(env, "TORCHNEURON_DTYPE_POLICY", "trainium", DTYPE_POLICIES),
        fallback_policy=_choice(env, "TORCHNEURON_FALLBACK", "warn", FALLBACK_POLICIES),
        local_rank=int(rank_text) if rank_text.isdigit() else None,
        cuda_compat=_flag(env, "TORCHNEURON_CUDA_COMPAT", False),
        porting_report=_get(env, "TORCHNEURON_PORTING_REPORT") or None,
        launch_blocking=_flag(env, "TORCHNEURON_LAUNCH_BLOCKING", False),
        stream_check=_flag(env, "TORCHNEURON_STREAM_CHECK", False),
        exit_timeout=_seconds(env, "TORCHNEURON_EXIT_TIMEOUT", 60.0),
        eager_fusion=_flag(env, "TORCHNEURON_EAGER_FUSION", True),
        fusion_compile_budget=_seconds(env, "TORCHNEURON_FUSION_COMPILE_BUDGET", 600.0),
        **_at_use_fields(env),
    )


# The process's configuration: read at the first ask (the device's registration), None when invalid (_ERROR).
_LOCK = threading.RLock()
_READ = False
_CURRENT: Config | None = None
_ERROR: str | None = None
_SEEN: tuple[str | None, ...] = ()  # the at-use variables' values _CURRENT was read with


def _read_once() -> None:
    global _READ, _CURRENT, _ERROR, _SEEN
    if not _READ:
        _SEEN = tuple(os.environ.get(n) for n in _AT_USE)
        try:
            _CURRENT = load()
        except ConfigError as e:
            _ERROR = str(e)
        _READ = True


def current_or_none() -> Config | None:
    """The process's configuration as read at registration, or None when it is invalid (see `error`)."""
    with _LOCK:
        _read_once()
        return _CURRENT


def error() -> str | None:
    """Why the process's configuration is invalid (None when it is valid)."""
    with _LOCK:
        _read_once()
        return _ERROR


def current() -> Config:
    """The process's configuration, its at-use settings following their variables. RuntimeError (the first use
    of the device) when it is invalid; ConfigError when an at-use variable was set to an invalid value since."""
    global _CURRENT, _SEEN
    with _LOCK:
        _read_once()
        if _CURRENT is None:
            raise RuntimeError(_ERROR)
        seen = tuple(os.environ.get(n) for n in _AT_USE)
        if seen != _SEEN:
            _CURRENT = replace(_CURRENT, **_at_use_fields(with_aliases(os.environ)))
            _SEEN = seen
        return _CURRENT


def update(**changes: object) -> Config:
    """Change fields of the process's configuration at run time (torchneuron.set_policies)."""
    global _CURRENT
    with _LOCK:
        _CURRENT = replace(current(), **changes)
        return _CURRENT


def torchrun_rank() -> tuple[str | None, int]:
    """The RANK and WORLD_SIZE torchrun gives a worker: (None, 1) elsewhere, and WORLD_SIZE 1 when malformed.
    PyTorch's own variables, not the device's configuration; read here, where every environment read is."""
    world = os.environ.get("WORLD_SIZE", "1").strip()
    return os.environ.get("RANK"), int(world) if world.isdigit() else 1


@contextlib.contextmanager
def scoped_env(name: str, value: str) -> Iterator[None]:
    """Set `name` for another library that reads it (Inductor's cache directory) during the block, then restore
    it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def default_env(name: str, value: str) -> None:
    """Set `name` for another library that reads it at import (HF_HUB_OFFLINE), unless the user set it."""
    os.environ.setdefault(name, value)
