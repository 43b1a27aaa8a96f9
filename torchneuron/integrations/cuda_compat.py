"""CUDA compatibility mode: run an unmodified CUDA script on `neuron`, counting every redirected call.

Two layers, so that names a script imported before `enable()` are covered too:
- a global `TorchFunctionMode` maps device arguments ("cuda", "cuda:1", `torch.device("cuda", i)`) to `neuron`
  in every torch function and Tensor method (factories, `to`, `new_*`, `.cuda()`, `.is_cuda`). It sees calls
  however the function was named, and Dynamo traces through it, so compiled code keeps working.
  `torch.device("cuda")` objects are left as they are: every consumer maps them.
- tables of `Redirect` rows wrap what a mode cannot see: class `__init__`s (autocast, GradScaler, DDP, DataLoader,
  DeviceMesh, profiler, compile wrappers), `Backend.__new__` ("nccl" -> "neuron"), checkpoint restore locations,
  storage `.cuda()`, `Module.cuda()`, and the `torch.cuda` module's functions (-> `torch.neuron`); `Module.to`
  is mapped inside the device's own wrapper of it (a conversion-argument hook), not wrapped a second time.

`torch.cuda.is_available()` returns True (and `device_count()` the neuron count): scripts pick their device with
it (`"cuda" if torch.cuda.is_available() else "cpu"`), and answering False would send them silently to the CPU
with AMP disabled. Everything a True answer leads to ("cuda" strings, nccl, `torch.cuda.*`) is redirected.
Each concern is one entry of the patch registry (`COMPAT`, torchneuron.runtime.patches). See docs/compat.md.
Compat mode is runtime behaviour, so it lives here and not in torchneuron.migrate (static analysis).
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import sysconfig
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import typing_extensions
from torch.overrides import TorchFunctionMode, resolve_name

from ..hardware import config
from ..runtime import patches

_COUNTS: Counter[tuple[str, str]] = Counter()  # (api, "file:line" of the user frame) -> calls
_QUIET = threading.local()  # inside one counted call (e.g. Module.cuda), its per-tensor redirects are not counted
_INTERNAL = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["torchneuron"]))
_TORCH_CODE = _INTERNAL  # callers whose torch.cuda queries are about the host, not the script
_INTERNAL += (sysconfig.get_paths()["stdlib"] + os.sep, typing_extensions.__file__)  # its @deprecated wrapper


def _site() -> str:
    """file:line of the innermost frame outside torch, torchneuron and the standard library."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(_INTERNAL) or f.f_code.co_filename.startswith("<frozen")):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "<unknown>"


def _record(api: str | Callable[[], str]) -> None:
    """Count one redirect. Skipped while Dynamo traces (the redirect is then baked into the graph) and inside an
    already counted call."""
    if torch.compiler.is_compiling() or getattr(_QUIET, "on", False):
        return
    _COUNTS[(api if isinstance(api, str) else api(), _site())] += 1


def redirects() -> dict[str, dict[str, int]]:
    """{api: {call site: count}} of the calls redirected so far."""
    out: dict[str, dict[str, int]] = {}
    for (api, site), n in sorted(_COUNTS.items()):
        out.setdefault(api, {})[site] = n
    return out


def clear_redirects() -> None:
    _COUNTS.clear()


def is_enabled() -> bool:
    return all(patches.is_active(p) for p in COMPAT)


def _is_cuda(d: Any) -> bool:
    return (isinstance(d, str) and (d == "cuda" or d.startswith("cuda:"))) or (
        isinstance(d, torch.device) and d.type == "cuda")


def _dev(d: Any, api: str | Callable[[], str]) -> Any:
    """A device-like value with "cuda" mapped to "neuron" (str, torch.device; ints are already the accelerator)."""
    if not _is_cuda(d):
        return d
    _record(api)
    return "neuron" + d[4:] if isinstance(d, str) else torch.device("neuron", d.index)


_IS_CUDA = torch._C.TensorBase.__dict__["is_cuda"]


class _DeviceMode(TorchFunctionMode):
    """Maps device arguments of torch functions and Tensor methods from cuda to neuron."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _IS_CUDA:  # the `Tensor.is_cuda` getter
            _record("Tensor.is_cuda")
            return args[0].device.type in ("cuda", "neuron")
        if func is torch.Tensor.cuda:
            _record("Tensor.cuda")
            func = torch.Tensor.neuron
            if len(args) > 1:
                args = (args[0], _dev(args[1], "Tensor.cuda"), *args[2:])
        elif func is torch.Tensor.type and (legacy := _legacy(args[1] if len(args) > 1 else kwargs.get("dtype"))):
            _record("Tensor.type(torch.cuda.*Tensor)")
            return args[0].to("neuron", legacy.dtype, non_blocking=kwargs.get("non_blocking", False))
        elif func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _dev(args[1], lambda: "Tensor.to(cuda)"), *args[2:])
        if "device" in kwargs:
            kwargs["device"] = _dev(kwargs["device"], lambda: f"{resolve_name(func) or func}(device=cuda)")
        return func(*args, **kwargs)


class _LegacyType(type):
    """torch.cuda.FloatTensor & co (older scripts: `Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor`):
    calling one builds what the CPU type builds (a size, data, a torch.Size), on neuron; `isinstance` holds for
    neuron tensors of its dtype; `x.type(torch.cuda.HalfTensor)` and `set_default_tensor_type` accept it."""

    dtype: torch.dtype
    cpu: Any  # the CPU legacy type of the same dtype (torch.FloatTensor for torch.cuda.FloatTensor)

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.Tensor:
        _record(f"torch.cuda.{cls.__name__}")
        if len(args) == 1 and isinstance(args[0], torch.Tensor):
            return args[0].to("neuron", cls.dtype)
        return cls.cpu(*args, **kwargs).to("neuron")

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor) and obj.device.type == "neuron" and obj.dtype == cls.dtype

    def __repr__(cls) -> str:
        return f"<class 'torch.cuda.{cls.__name__}'>"


LEGACY_TYPES: dict[str, _LegacyType] = {
    name: _LegacyType(name, (), {"dtype": getattr(torch, name).dtype, "cpu": getattr(torch, name), "is_cuda": True,
                                 "__module__": "torch.cuda"})
    for name in ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
                 "ShortTensor", "IntTensor", "LongTensor", "BoolTensor")}


def _legacy(t: Any) -> _LegacyType | None:
    """The compat legacy type that `t` names (the class, or its "torch.cuda.FloatTensor" string), else None."""
    if isinstance(t, _LegacyType):
        return t
    if isinstance(t, str) and t.startswith("torch.cuda."):
        return LEGACY_TYPES.get(t[len("torch.cuda."):])
    return None


_DEFAULT = threading.local()  # on_neuron: a torch.cuda type made neuron the default device (thread-local, as it)


def _set_default_tensor_type(orig: Callable) -> Callable:
    """set_default_tensor_type(torch.cuda.HalfTensor) (LLaMA's reference code): that dtype, on neuron by default;
    a later CPU type puts the default device back, as on CUDA."""
    @functools.wraps(orig)
    def set_default_tensor_type(t: Any) -> None:
        legacy = _legacy(t)
        if legacy is None:
            if getattr(_DEFAULT, "on_neuron", False):
                torch.set_default_device(None)
                _DEFAULT.on_neuron = False
            return orig(t)
        _record("torch.set_default_tensor_type(cuda)")
        orig(legacy.cpu)  # PyTorch's own checks (floating types only) and default dtype
        torch.set_default_device("neuron")
        _DEFAULT.on_neuron = True
    return set_default_tensor_type


def _quietly(api: str, fn: Callable) -> Callable:
    """`fn` counted once as `api`, with the redirects it makes internally not counted."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _record(api)
        _QUIET.on, was = True, getattr(_QUIET, "on", False)
        try:
            return fn(*args, **kwargs)
        finally:
            _QUIET.on = was
    return wrapper


def _map_args(fn: Callable, api: str, names: tuple[str, ...], defaults: dict[str, Any] | None = None) -> Callable:
    """Wrap `fn` so the arguments `names` (by keyword or position) have cuda devices mapped to neuron.
    `defaults` gives arguments whose omitted default means CUDA (GradScaler's device="cuda")."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind_partial(*args, **kwargs)
        for k, v in (defaults or {}).items():
            bound.arguments.setdefault(k, v)
        for n in names:
            if n in bound.arguments:
                bound.arguments[n] = _map_value(bound.arguments[n], api)
        return fn(*bound.args, **bound.kwargs)
    return wrapper


def _map_value(v: Any, api: str) -> Any:
    if isinstance(v, (list, tuple)):
        return type(v)(_map_value(x, api) for x in v)
    return _dev(v, api)


def _autocast_init(orig: Callable) -> Callable:
    """autocast("cuda") -> "neuron", keeping CUDA's default dtype (fp16) so the script's numerics hold."""
    @functools.wraps(orig)
    def __init__(self, device_type: str, dtype: torch.dtype | None = None, *args, **kwargs):
        if device_type == "cuda":
            _record(_public_name(type(self)) + ("" if type(self).__module__.startswith("torch.cuda") else "(cuda)"))
            device_type, dtype = "neuron", dtype or torch.get_autocast_dtype("cuda")
        orig(self, device_type, dtype, *args, **kwargs)
    return __init__


def _scaler_init(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def __init__(self, device: str = "cuda", *args, **kwargs):
        if device == "cuda":
            _record(_public_name(type(self)) + ("" if type(self).__module__.startswith("torch.cuda") else "(cuda)"))
            device = "neuron"
        orig(self, device, *args, **kwargs)
    return __init__


def _public_name(cls: type) -> str:
    parts = [p for p in cls.__module__.split(".") if p not in ("grad_scaler", "autocast_mode")]
    return ".".join([*parts, cls.__qualname__])


def _compile_mode(orig: Callable) -> Callable:
    """CUDA-graph compile modes -> the default mode (the neuron backend has no CUDA graphs)."""
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        bound = inspect.signature(orig).bind(self, *args, **kwargs)
        if bound.arguments.get("mode") in ("reduce-overhead", "max-autotune"):
            _record(f"torch.compile(mode={bound.arguments['mode']!r})")
            bound.arguments["mode"] = None
        orig(*bound.args, **bound.kwargs)
    return __init__


def _profiler_init(orig: Callable) -> Callable:
    act = torch.profiler.ProfilerActivity

    @functools.wraps(orig)
    def __init__(self, *args, activities=None, **kwargs):
        if activities is not None and act.CUDA in activities:
            _record("torch.profiler.ProfilerActivity.CUDA")
            activities = [act.PrivateUse1 if a == act.CUDA else a for a in activities]
        orig(self, *args, activities=activities, **kwargs)
    return __init__


def _loader_init(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def __init__(self, *args, pin_memory_device: str = "", **kwargs):
        if pin_memory_device.startswith("cuda"):  # deprecated and ignored: pinning targets the current accelerator
            _record("DataLoader(pin_memory_device=cuda)")
            pin_memory_device = ""
        orig(self, *args, pin_memory_device=pin_memory_device, **kwargs)
    return __init__


def _backend_new(orig: Callable) -> Callable:
    """Backend("nccl") -> "neuron" (also in "cuda:nccl,cpu:gloo" forms): init_process_group and new_group
    construct a Backend from the user's string."""
    def __new__(cls, name: str):
        if isinstance(name, str) and "nccl" in name.lower():
            _record(f"torch.distributed backend {name!r}")
            name = name.lower().replace("cuda:", "neuron:").replace("nccl", "neuron")
        return orig(cls, name)
    return staticmethod(__new__)


def _backend_config_init(orig: Callable) -> Callable:
    """A group made with "gloo" carries CUDA tensors on CUDA (gloo's capability lists cpu and cuda), so here its
    neuron tensors go to the neuron backend (gloo on host views of device memory); `dist.get_backend()` stays
    "gloo"."""
    @functools.wraps(orig)
    def __init__(self, backend: Any) -> None:
        orig(self, backend)
        m = self.device_backend_map
        if m.get("cuda") == "gloo" and "neuron" not in m:
            _record("torch.distributed backend 'gloo' (cuda tensors)")
            m["neuron"] = torch.distributed.Backend("neuron")
    return __init__


def _restore_location(orig: Callable) -> Callable:
    """Checkpoint storages saved on, or mapped to, cuda are restored on neuron."""
    @functools.wraps(orig)
    def restore(storage, location):
        return orig(storage, _dev(location, "torch.load(cuda location)"))
    return restore


class _CompatMeta(type(torch._C.Generator)):
    """isinstance(x, replacement) also holds for instances of the class it replaces (C-created Generators)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls.__mro__[1])


class _Generator(torch._C.Generator, metaclass=_CompatMeta):
    def __new__(cls, device: Any = "cpu"):
        return torch._C.Generator(_dev(device, "torch.Generator(device=cuda)"))


class _AcceptsMeta(type):
    """isinstance(x, cls) also holds for instances of `cls._accepts` (set on the class itself, not inherited)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        accepts = cls.__dict__.get("_accepts")
        return type.__instancecheck__(cls, obj) or (accepts is not None and isinstance(obj, accepts))


def _compat_classes() -> dict[str, type]:
    """torch.cuda.Stream/Event replacements: neuron streams/events that also subclass the originals, so
    isinstance(s, torch.cuda.Stream) holds whichever name the script kept, and also for the streams and events
    torch.neuron hands back (`torch.cuda.current_stream()`, `stream.record_event()`)."""
    import torch.cuda.streams as cs
    from torch.neuron import Event, Stream

    class CudaStream(Stream, cs.Stream, metaclass=_AcceptsMeta):
        _accepts = Stream

        def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any):
            _record("torch.cuda.Stream")
            return Stream.__new__(cls, _dev(device, "torch.cuda.Stream"), priority, **kwargs)

        def __init__(self, *args: Any, **kwargs: Any) -> None:  # the dummy CUDA base's __init__ raises
            pass

    class CudaEvent(Event, cs.Event, metaclass=_AcceptsMeta):
        _accepts = Event

        def __new__(cls, *args: Any, **kwargs: Any):
            _record("torch.cuda.Event")
            return object.__new__(cls)

    return {"Stream": CudaStream, "Event": CudaEvent}


class _NoCUDAGraph:
    """torch.cuda.CUDAGraph (and so torch.cuda.graph and make_graphed_callables, which build one): an error that
    says what to do, instead of PyTorch's "Tried to instantiate dummy base class CUDAGraph"."""

    def __new__(cls, *args: Any, **kwargs: Any):
        _record("torch.cuda.CUDAGraph")
        raise RuntimeError(
            "CUDA graphs (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.make_graphed_callables) do not exist on "
            "neuron: run the captured code eagerly, or compile it with torch.compile (mode='reduce-overhead' runs "
            "without CUDA graphs under CUDA compatibility mode). See docs/compat.md")


def _builds(new: type) -> staticmethod:
    """A `__new__` for a replaced class: constructing it (under a name kept from before) builds `new` instead."""
    def __new__(cls, *args: Any, **kwargs: Any):
        return new.__new__(new, *args, **kwargs)
    return staticmethod(__new__)


def _from_torch() -> bool:
    """Is the caller of a patched `torch.cuda` function torch or torchneuron itself? Inductor, Dynamo and the
    rest of PyTorch ask `torch.cuda` about the host (is there CUDA? which architecture?) and must keep getting the
    real answers, so that every model that compiles without compat mode compiles with it."""
    return sys._getframe(2).f_code.co_filename.startswith(_TORCH_CODE)


def _cuda_functions() -> dict[str, Callable]:
    """torch.cuda.<name> -> its torch.neuron counterpart (device arguments mapped, call counted) for calls from
    the script and its libraries; torch's own calls reach the original."""
    n = torch.neuron
    same = ("device_count current_device set_device synchronize current_stream default_stream set_stream stream "
            "device device_of StreamContext memory_allocated memory_reserved max_memory_allocated "
            "max_memory_reserved reset_peak_memory_stats reset_max_memory_allocated reset_accumulated_memory_stats "
            "memory_stats memory_summary empty_cache mem_get_info manual_seed manual_seed_all seed seed_all "
            "initial_seed get_rng_state get_rng_state_all set_rng_state set_rng_state_all get_device_name "
            "get_device_properties get_device_capability is_initialized init set_per_process_memory_fraction "
            "get_per_process_memory_fraction memory_snapshot").split()
    table: dict[str, Callable] = {name: getattr(n, name) for name in same}
    table |= {"is_available": lambda: n.device_count() > 0, "is_bf16_supported": lambda *a, **k: True,
              "memory_cached": n.memory_reserved, "max_memory_cached": n.max_memory_reserved,
              "reset_max_memory_cached": n.reset_peak_memory_stats,
              "is_current_stream_capturing": lambda: False,  # neuron has no CUDA graphs: never capturing
              "ipc_collect": lambda: None,  # neuron memory is never shared between processes: no IPC handles
              # CUDA's sync debug mode warns at host syncs of CUDA ops; neuron has none to report: off, always
              "set_sync_debug_mode": lambda debug_mode: None, "get_sync_debug_mode": lambda: 0}
    out = {}
    for name, target in table.items():
        if name == "device":
            out[name] = _device_class(target)
            continue
        if isinstance(target, type):  # the context-manager classes (device_of, StreamContext): not counted
            out[name] = target
            continue
        out[name] = _for_the_script(f"torch.cuda.{name}", target, getattr(torch.cuda, name))
    return out


def _for_the_script(api: str, target: Callable, orig: Callable) -> Callable:
    """`target` (device arguments mapped, the call counted as `api`) for the script's calls; `orig` for torch's."""
    @functools.wraps(orig)
    def fn(*args, **kwargs):
        if _from_torch():
            return orig(*args, **kwargs)
        _record(api)
        return target(*(_map_value(a, api) for a in args), **{k: _map_value(v, api) for k, v in kwargs.items()})
    return fn


def _device_class(neuron_device: type) -> type:
    """`with torch.cuda.device(torch.device("cuda", i))`: torch.neuron.device with the argument mapped."""
    class device(neuron_device):
        def __init__(self, device: Any) -> None:
            super().__init__(_map_value(device, "torch.cuda.device"))

    device.__module__, device.__qualname__ = "torch.cuda", "device"
    return device


def _autocast_queries() -> list[Redirect]:
    """torch.is_autocast_enabled() / ("cuda"), torch.get_autocast_dtype("cuda"), torch.get_autocast_gpu_dtype():
    the script asks about the autocast it entered with "cuda", which runs on neuron (modelling code branches on
    them: `if torch.is_autocast_enabled(): dtype = torch.get_autocast_gpu_dtype()`). torch's own calls (autocast's
    __init__ asking CUDA's default dtype) get the original."""
    dtype_of = torch.get_autocast_dtype

    def query(name: str, orig: Callable) -> Callable:
        @functools.wraps(orig)
        def fn(*args: Any, **kwargs: Any) -> Any:
            if _from_torch():
                return orig(*args, **kwargs)
            if name == "get_autocast_gpu_dtype":
                _record("torch.get_autocast_gpu_dtype")
                return dtype_of("neuron")
            if not args and not kwargs and name == "is_autocast_enabled":  # no argument: CUDA's state
                _record("torch.is_autocast_enabled()")
                return orig("neuron")
            api = f"torch.{name}(cuda)"
            return orig(*(_map_value(a, api) for a in args), **{k: _map_value(v, api) for k, v in kwargs.items()})
        return fn

    names = ("is_autocast_enabled", "get_autocast_dtype", "get_autocast_gpu_dtype")
    return [Redirect(torch, n, lambda f, n=n: query(n, f)) for n in names]


_RANGES = threading.local()  # the open NVTX-style ranges of this thread: a push/pop stack and start/end handles


def _nvtx_functions() -> dict[str, Callable]:
    """torch.cuda.nvtx.* -> ranges of the PyTorch profiler (`record_function`), which neuron traces carry.
    Without this, NVTX annotations raise "NVTX functions not installed" on every non-CUDA build."""
    from torch.autograd.profiler import record_function

    def state() -> tuple[list, dict]:
        if not hasattr(_RANGES, "stack"):
            _RANGES.stack, _RANGES.open, _RANGES.next = [], {}, 0
        return _RANGES.stack, _RANGES.open

    def range_push(msg: str) -> int:
        _record("torch.cuda.nvtx.range_push")
        stack, _ = state()
        stack.append(record_function(str(msg)).__enter__())
        return len(stack) - 1

    def range_pop() -> int:
        _record("torch.cuda.nvtx.range_pop")
        stack, _ = state()
        if stack:  # NVTX returns -1 for an unmatched pop rather than raising
            stack.pop().__exit__(None, None, None)
        return len(stack) - 1 if stack else -1

    def range_start(msg: str) -> int:
        _record("torch.cuda.nvtx.range_start")
        _, open_ = state()
        _RANGES.next += 1
        open_[_RANGES.next] = record_function(str(msg)).__enter__()
        return _RANGES.next

    def range_end(range_id: int) -> None:
        _record("torch.cuda.nvtx.range_end")
        if (rf := state()[1].pop(range_id, None)) is not None:
            rf.__exit__(None, None, None)

    def mark(msg: str) -> None:
        _record("torch.cuda.nvtx.mark")
        with record_function(str(msg)):
            pass

    def range(msg: str, *args: Any, **kwargs: Any) -> record_function:  # a context manager and a decorator
        _record("torch.cuda.nvtx.range")
        return record_function(msg.format(*args, **kwargs))

    return {f.__name__: f for f in (range_push, range_pop, range_start, range_end, mark, range)}


class Redirect(NamedTuple):
    """owner.attr becomes make(original)."""

    owner: Any
    attr: str
    make: Callable[[Any], Any]


def _constructor_rows() -> list[Redirect]:
    return [
        Redirect(torch.amp.autocast_mode.autocast, "__init__", _autocast_init),  # torch.autocast, amp, cuda.amp
        Redirect(torch.amp.GradScaler, "__init__", _scaler_init),  # also torch.cuda.amp.GradScaler (a subclass)
        Redirect(torch, "Generator", lambda _: _Generator),
        Redirect(torch.utils.data.DataLoader, "__init__", _loader_init),
        Redirect(torch._TorchCompileInductorWrapper, "__init__", _compile_mode),
        Redirect(torch._TorchCompileWrapper, "__init__", _compile_mode),
        Redirect(torch.profiler.profiler._KinetoProfile, "__init__", _profiler_init),
        Redirect(torch, "set_default_tensor_type", _set_default_tensor_type),
        *(Redirect(torch.cuda, name, lambda f, t=t: t) for name, t in LEGACY_TYPES.items()),
        Redirect(torch, "set_default_device", lambda f: _map_args(f, "torch.set_default_device(cuda)", ("device",))),
        Redirect(torch.amp, "custom_fwd", lambda f: _map_args(f, "torch.amp.custom_fwd(device_type=cuda)",
                                                              ("device_type",))),
        Redirect(torch.amp, "custom_bwd", lambda f: _map_args(f, "torch.amp.custom_bwd(device_type=cuda)",
                                                              ("device_type",)))]


def _module_storage_rows() -> list[Redirect]:
    import torch.serialization as ser

    mod, stor = torch.nn.Module, torch.storage
    storage_cuda = _quietly("Storage.cuda", lambda s, *a, **k: s.neuron(*a, **k))
    return [
        Redirect(ser, "default_restore_location", _restore_location),  # every map_location form ends here
        Redirect(torch.UntypedStorage, "cuda", lambda f: storage_cuda),
        Redirect(stor.TypedStorage, "cuda", lambda f: storage_cuda),
        Redirect(stor.TypedStorage, "is_cuda", lambda f: property(lambda s: s.device.type in ("cuda", "neuron"))),
        Redirect(mod, "cuda", lambda f: _quietly("Module.cuda", lambda m, device=None: m.neuron(device)))]


def _module_to(orig: Callable) -> Callable:
    """Module.to with cuda devices mapped to neuron (counted once per call, not per parameter). The conversion
    itself is PyTorch's in-place one, as for CUDA: the device answers `_has_compatible_shallow_copy_type`."""
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        if _mentions_cuda(args, kwargs):
            api = "Module.to(cuda)"
            args, kwargs = tuple(_map_value(a, api) for a in args), {k: _map_value(v, api) for k, v in kwargs.items()}
        return orig(self, *args, **kwargs)
    return to


def _distributed_rows() -> list[Redirect]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rows = [Redirect(DDP, "__init__", lambda f: _map_args(f, "DistributedDataParallel(device_ids=cuda)",
                                                          ("device_ids", "output_device"))),
            Redirect(dist.Backend, "__new__", _backend_new),
            Redirect(dist, "is_nccl_available", lambda f: lambda: True)]
    if dist.is_available():
        import torch.distributed.device_mesh as dm
        c10d = dist.distributed_c10d
        rows += [Redirect(c10d.BackendConfig, "__init__", _backend_config_init),
                 Redirect(dm.DeviceMesh, "__init__", lambda f: _map_args(f, "DeviceMesh(cuda)", ("device_type",))),
                 Redirect(dm, "init_device_mesh", lambda f: _map_args(f, "init_device_mesh(cuda)", ("device_type",))),
                 Redirect(dist, "init_device_mesh", lambda f: dm.init_device_mesh),
                 Redirect(c10d, "init_process_group", lambda f: _map_args(f, "init_process_group(device_id=cuda)",
                                                                          ("device_id",))),
                 Redirect(dist, "init_process_group", lambda f: c10d.init_process_group)]
    return rows


def _torch_cuda_rows() -> list[Redirect]:
    import torch.cuda.streams as cs

    classes = _compat_classes()
    rows = [Redirect(cs.Stream, "__new__", lambda f: _builds(classes["Stream"])),  # names imported before enable()
            Redirect(cs.Event, "__new__", lambda f: _builds(classes["Event"]))]
    rows += [Redirect(torch.cuda, "CUDAGraph", lambda f: _NoCUDAGraph),
             Redirect(torch.cuda.graphs, "CUDAGraph", lambda f: _NoCUDAGraph)]  # make_graphed_callables' name
    table = _cuda_functions()
    functions = [Redirect(torch.cuda, name, lambda f, v=v: v) for name, v in {**table, **classes}.items()]
    # the same functions under their submodules' names (torch.cuda.random.manual_seed, torch.cuda.memory.*)
    for mod in (torch.cuda.random, torch.cuda.memory):
        functions += [Redirect(mod, name, lambda f, v=v: v) for name, v in table.items()
                      if vars(mod).get(name) is getattr(torch.cuda, name, None) is not None]
    functions += [Redirect(torch.cuda.memory, name, lambda f, name=name: _for_the_script(
        f"torch.cuda.memory.{name}", getattr(torch.neuron.memory, name), f))
        for name in ("_record_memory_history", "_snapshot", "_dump_snapshot")]  # PyTorch's memory-debugging recipe
    return rows + functions + _autocast_queries()


def _nvtx_rows() -> list[Redirect]:
    return [Redirect(torch.cuda.nvtx, name, lambda f, v=v: v) for name, v in _nvtx_functions().items()]


def _redirecting(rows: Callable[[], list[Redirect]]) -> Callable[[patches.Applied], None]:
    def apply(done: patches.Applied) -> None:
        for r in rows():
            done.replace(r.owner, r.attr, r.make(getattr(r.owner, r.attr)))
    return apply


_MODE: list[_DeviceMode] = []  # the mode enable() entered


def _enter_mode(done: patches.Applied) -> None:
    _MODE.append(_DeviceMode())
    _MODE[-1].__enter__()  # stays on the mode stack for the life of the process (or until undone)


def _exit_mode() -> None:
    top = torch._C._len_torch_function_stack() - 1
    if top < 0 or torch._C._get_function_stack_at(top) is not _MODE[-1]:
        raise RuntimeError("CUDA compatibility mode cannot be undone here: its TorchFunctionMode is not the "
                           "innermost mode of this thread")
    _MODE.pop().__exit__(None, None, None)


def _compat_patch(name: str, target: str, why: str, test: str, apply: Callable[[patches.Applied], None],
                  undo: Callable[[], None] | None = None) -> patches.Patch:
    return patches.declare(name, target, why, f"tests/test_migrate_compat.py::{test}", apply, undo=undo,
                           when="compat")


COMPAT = (  # applied in this order by enable(); the mode last
    _compat_patch(
        "cuda-compat-constructors", "__init__ of torch.autocast, torch.amp.GradScaler, DataLoader, torch.compile's "
        "wrappers, torch.profiler.profile; torch.Generator, torch.set_default_device, set_default_tensor_type, "
        "torch.amp.custom_fwd/custom_bwd, the legacy torch.cuda.*Tensor types", "device_type='cuda', CUDA-graph "
        "compile modes, ProfilerActivity.CUDA, pin_memory_device='cuda', default devices and legacy types target "
        "neuron",
        "test_redirect_depth_isinstance_and_compile", _redirecting(_constructor_rows)),
    _compat_patch(
        "cuda-compat-module-storage", "torch.nn.Module.cuda, UntypedStorage/TypedStorage .cuda and .is_cuda, "
        "torch.serialization.default_restore_location",
        "module.cuda(), storage.cuda() and checkpoints saved on cuda land on neuron",
        "test_redirect_depth_isinstance_and_compile", _redirecting(_module_storage_rows)),
    _compat_patch(
        "cuda-compat-module-to", "torch.nn.Module.to",
        "module.to('cuda') converts to neuron in place, keeping parameters and ties",
        "test_module_to_cuda_keeps_parameters", _redirecting(lambda: [Redirect(torch.nn.Module, "to", _module_to)])),
    _compat_patch(
        "cuda-compat-distributed", "DistributedDataParallel.__init__, torch.distributed.Backend.__new__, "
        "BackendConfig.__init__ (gloo also carries neuron tensors), "
        "is_nccl_available, init_process_group, DeviceMesh, init_device_mesh",
        "nccl and cuda device ids and meshes become the neuron backend and devices",
        "test_ddp_under_torchrun_with_nccl", _redirecting(_distributed_rows)),
    _compat_patch(
        "cuda-compat-torch-cuda", "torch.cuda.* (device, memory, RNG and stream functions; Stream, Event), "
        "torch.cuda.streams.Stream/Event.__new__",
        "the script's torch.cuda calls reach torch.neuron; torch's own calls (a caller check) get the host's answers",
        "test_compile_under_bf16_autocast_and_nvtx_ranges", _redirecting(_torch_cuda_rows)),
    _compat_patch(
        "cuda-compat-nvtx", "torch.cuda.nvtx.*", "NVTX ranges become PyTorch profiler ranges (NVTX is absent off CUDA)",
        "test_compile_under_bf16_autocast_and_nvtx_ranges", _redirecting(_nvtx_rows)),
    _compat_patch(
        "cuda-compat-device-arguments", "the torch function mode stack (a global TorchFunctionMode)",
        "'cuda' device arguments of every torch function and Tensor method become 'neuron'",
        "test_redirect_depth_isinstance_and_compile", _enter_mode, _exit_mode),
)


def _mentions_cuda(args: tuple, kwargs: dict) -> bool:
    return any(_is_cuda(v) for v in (*args, *kwargs.values()))


def enable() -> None:
    """Turn compatibility mode on for this process (idempotent). Each concern is one patch of the registry
    (`COMPAT`); `disable()` undoes them, but objects built meanwhile (streams, scalers, ...) stay what they are."""
    for p in COMPAT:
        patches.apply(p)


def disable() -> None:
    """Undo every compat patch (the originals are back; objects built under the mode stay as they are)."""
    for p in reversed(COMPAT):
        patches.undo(p)


def maybe_enable_from_env() -> None:
    """Autoload hook: TORCHNEURON_CUDA_COMPAT=1 enables the mode (torchneuron's import also registers the porting
    report at exit under TORCHNEURON_PORTING_REPORT: the report reads this module, not the other way round)."""
    cfg = config.current_or_none()  # an invalid configuration (None) is raised at the first use of the device
    if is_enabled() or cfg is None or not cfg.cuda_compat:
        return
    enable()
