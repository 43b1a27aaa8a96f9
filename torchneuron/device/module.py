"""Device selection and properties of `torch.neuron`, mirroring `torch.cuda`, and the backend registration."""
from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _C
from ..hardware import config as _config
from ..runtime import patches
from . import flex_attention, parallel
from .storage import STORAGE_CLASSES

_registered = _initialized = _warned = False  # _initialized: usable (validated), as torch.cuda.is_initialized
_device_t = torch.device | str | int | None


def config() -> _config.Config:
    """The modelled machine and policies this process runs with (read from the environment at registration)."""
    _lazy_init()
    return _config.current()


def register() -> None:
    """Make PrivateUse1 the `neuron` device: the C++ core, `torch.neuron`, and the generated methods.

    It never fails on the environment (installing torchneuron must not break `import torch` for CPU work): an
    invalid configuration leaves zero usable devices and its error is raised at the first use of `neuron`
    (`_lazy_init`, as torch.cuda's lazy initialisation); so is a LOCAL_RANK beyond the visible cores."""
    global _registered, _initialized
    if _registered:
        return
    from ..runtime import optable, policy

    cfg, error = _config.current_or_none(), _config.error()  # the one read of the environment
    _C._init([cfg.core_capacity] * cfg.device_count if cfg else [], error or "", optable.device_checked(),
             optable.names("one_kernel"))
    _registered = True
    _initialized = cfg is not None and cfg.local_rank_error is None
    policy.install_op_tables()
    if cfg is not None:
        policy.set_policies()
        _C._set_launch_blocking(cfg.launch_blocking)
        atexit.register(_at_exit)  # registered at `import torch`: runs after the atexit handlers of the program
        os.register_at_fork(before=_C._drain_all)  # the child's copy of memory holds finished results
    for p in (NEURON_DEVICE, REFUSE_SHARING, PRINT_WITHOUT_DTYPE_EVENTS, GRAD_SCALER_WITHOUT_DTYPE_EVENTS,
              LOADED_TENSORS_TAKE_THE_DTYPE_RULES,
              BACKWARD_ON_CALLING_THREAD,
              STORAGE_CLASSES, flex_attention.WIDEN_DEVICE_CHECK, parallel.DATA_PARALLEL_COMM):
        patches.apply(p)
    if cfg is not None and cfg.stream_check:  # TORCHNEURON_STREAM_CHECK=1
        from . import stream_check

        stream_check.enable()
    if _initialized and cfg.local_rank is not None:  # under torchrun each rank starts on its own logical core
        torch._C._accelerator_hooks_set_current_device(cfg.local_rank)


def _lazy_init() -> None:
    """Called at each use of the device (PyTorch calls it before a tensor is made on `neuron` and in
    torch.accelerator; so do torch.neuron's queries and the compiler). A valid configuration is initialised at
    registration; otherwise its error, or LOCAL_RANK naming a core this process does not see, is raised here as
    a RuntimeError (as torch.cuda's lazy initialisation raises a driver's failure). In a forked child of a parent
    that had used the device it raises CUDA's "Cannot re-initialize ... in forked subprocess" (csrc/lifecycle.cpp)."""
    _C._check_device_use()
    if not _initialized:
        if not _registered:
            raise RuntimeError("torchneuron is not registered yet: import torchneuron (or torch with autoload on)")
        cfg = _config.current_or_none()
        raise RuntimeError(cfg.local_rank_error if cfg else _config.error())



def _refuse_sharing_between_processes(done: patches.Applied) -> None:
    """Sending a neuron tensor or storage to another process (a DataLoader worker's batch, a multiprocessing
    queue) raises a clear error in the receiving process.

    torch.multiprocessing's reducers share CPU memory through file descriptors and CUDA memory through IPC
    handles; device memory here is private to the process, so sharing is impossible (a copy would silently
    break in-place updates). Raising inside the reducer would not help: a queue pickles in a feeder thread that
    only prints the error and drops the item, so a DataLoader would wait forever. The reducer therefore pickles
    the error itself, and the receiver raises it where it takes the item (DataLoader's `next`). CPU memory is
    shared once the device's queued work has run: a queued copy into pinned memory (a spawned DataLoader worker's
    dataset, made right before the loader starts) is complete in the receiver, as a fork's child's copy is."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reducers first; imported by torch already)

    def refusing(reduce):
        @functools.wraps(reduce)
        def reducer(obj):
            if getattr(obj, "_untyped_storage", obj).device.type == "neuron":  # (TypedStorage.device warns)
                what = f"tensor of shape {tuple(obj.shape)}" if isinstance(obj, torch.Tensor) else "storage"
                return _raise_unshareable, (
                    f"a neuron {what} was sent from process {os.getpid()} (e.g. a DataLoader worker) to this one: "
                    "neuron memory cannot be shared between processes. Return CPU tensors from DataLoader workers "
                    "and move the batch to neuron in the main process (as PyTorch advises for CUDA tensors)",)
            _C._drain_all()  # the receiver reads the memory as it is now: queued writes into it first
            return reduce(obj)
        return reducer

    storages = (torch.Tensor, torch.UntypedStorage, torch.storage.TypedStorage)
    for cls, reduce in list(ForkingPickler._extra_reducers.items()):
        if isinstance(cls, type) and issubclass(cls, storages):
            done.replace_item(ForkingPickler._extra_reducers, cls, refusing(reduce))  # as ForkingPickler.register


def _raise_unshareable(message: str) -> None:
    raise RuntimeError(message)


def _as_internal_math(plain: Callable) -> Callable:
    """`plain` run with the dtype policy off (`_C._set_internal_math`): torch's own float64 math, not the program's."""
    @functools.wraps(plain)
    def wrapped(*args, **kwargs):
        was = _C._set_internal_math(True)
        try:
            return plain(*args, **kwargs)
        finally:
            _C._set_internal_math(was)
    return wrapped


def _print_without_dtype_events(done: patches.Applied) -> None:
    """Printing a tensor must not report the user's program: torch/_tensor_str.py lays out numbers with float64
    math (max/min ratios, rounding checks) that would trip the float64 rule on the first print. That math runs
    with the dtype policy off; the values printed are the device's, already held to the policy."""
    import torch._tensor_str as tensor_str

    done.replace(tensor_str, "_str", _as_internal_math(tensor_str._str))


def _register_device(done: patches.Applied) -> None:
    torch.utils.rename_privateuse1_backend("neuron")
    torch._register_device_module("neuron", sys.modules[__package__])  # torchneuron.device is torch.neuron
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)


def _grad_scaler_without_dtype_events(done: patches.Applied) -> None:
    """GradScaler.unscale_ takes its scale's reciprocal in float64 (`_scale.double().reciprocal().float()`: torch's
    own precision choice, a float32 comes out), which tripped the float64 rule and warned on every fp16 AMP step.
    That math runs with the dtype policy off, as printing's does; the gradients it unscales are the user's."""
    from torch.amp.grad_scaler import GradScaler

    done.replace(GradScaler, "unscale_", _as_internal_math(GradScaler.unscale_))


_HELD_TO_RULES = (torch.float64, torch.complex128, torch.int64)  # the dtypes the Trainium rules look at on entry


def _loaded_tensors_take_the_dtype_rules(done: patches.Applied) -> None:
    """`torch.load(map_location="neuron")` moves each storage as raw bytes (`UntypedStorage.to`), which no dtype
    rule can see; the tensors are rebuilt over them in `torch._utils._rebuild_tensor` (every load path, weights_only
    too). There a float64 or int64 tensor on the device enters it as a host->device copy would: its values are
    copied in again (rounded, int64 range checked, warned and counted as `.to("neuron")` is)."""
    import torch._utils as utils

    def _rebuild_tensor(storage, storage_offset, size, stride):
        t = plain(storage, storage_offset, size, stride)
        if t.device.type == "neuron" and t.dtype in _HELD_TO_RULES and t.numel() \
                and _config.current().dtype_policy == "trainium":
            into = t if torch._debug_has_internal_overlap(t) == 0 else \
                torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())  # (an expanded t)
            into.copy_(into.cpu())
        return t
    plain = utils._rebuild_tensor
    done.replace(utils, "_rebuild_tensor", functools.wraps(plain)(_rebuild_tensor))


def _backward_on_calling_thread(done: patches.Applied) -> None:
    """Backward runs on the calling thread, as on the CPU. PyTorch gives each accelerator an autograd worker
    thread so host and device work overlap; this device executes on the host synchronously, so that thread only
    adds a hand-off (~190 us per backward call on a 2-core box). Thread-local: set for the importing thread."""
    torch.autograd.set_multithreading_enabled(False)


NEURON_DEVICE = patches.declare(
    "neuron-device", "torch: PrivateUse1 renamed `neuron`, torch.neuron, Tensor/Module/Storage/PackedSequence "
    ".neuron() and .is_neuron", "the device itself, through PyTorch's PrivateUse1 extension API",
    "tests/test_registration.py::test_generated_methods_and_module", _register_device,
    no_undo="PyTorch has no way to rename PrivateUse1 back or unregister a device module")
REFUSE_SHARING = patches.declare(
    "refuse-sharing-neuron-memory", "multiprocessing.reduction.ForkingPickler reducers of torch.Tensor, "
    "torch.UntypedStorage, torch.storage.TypedStorage",
    "a neuron tensor sent to another process raises a clear error there instead of hanging a DataLoader; CPU "
    "memory is sent after the device's queued writes into it",
    "tests/test_dataloader.py::test_worker_returning_a_neuron_tensor_raises_in_the_main_process",
    _refuse_sharing_between_processes)
PRINT_WITHOUT_DTYPE_EVENTS = patches.declare(
    "print-without-dtype-events", "torch._tensor_str._str",
    "printing a tensor does not trip the float64 rule with torch's own layout math",
    "tests/test_device_rules.py::test_printing_does_not_report_dtype_events", _print_without_dtype_events)
GRAD_SCALER_WITHOUT_DTYPE_EVENTS = patches.declare(
    "grad-scaler-without-dtype-events", "torch.amp.grad_scaler.GradScaler.unscale_",
    "an fp16 AMP step does not trip the float64 rule with GradScaler's own float64 reciprocal of its scale",
    "tests/test_autocast.py::test_grad_scaler_steps_without_dtype_events", _grad_scaler_without_dtype_events)
LOADED_TENSORS_TAKE_THE_DTYPE_RULES = patches.declare(
    "loaded-tensors-take-the-dtype-rules", "torch._utils._rebuild_tensor",
    "a float64 or int64 checkpoint loaded onto the device is held to the Trainium rules as `.to(\"neuron\")` is "
    "(torch.load moves storages as raw bytes, which no dtype rule sees)",
    "tests/test_serialization.py::test_a_checkpoint_loaded_onto_the_device_is_held_to_the_dtype_rules",
    _loaded_tensors_take_the_dtype_rules)
BACKWARD_ON_CALLING_THREAD = patches.declare(
    "backward-on-calling-thread", "torch.autograd.set_multithreading_enabled (the importing thread)",
    "backward runs on the calling thread: the device executes on the host, a worker thread only adds a hand-off",
    "tests/test_autograd.py::test_backward_runs_on_the_calling_thread", _backward_on_calling_thread,
    undo=lambda: torch.autograd.set_multithreading_enabled(True))  # PyTorch's default, on the calling thread


def is_available() -> bool:
    """Never raises: False when the configuration is invalid, as torch.cuda when its driver cannot initialise, and
    in a forked child of a parent that had used the device, where any device use raises. torch.cuda says True there;
    False lets code that checks first (Dynamo tracing a CPU function asks for the current stream only if an
    accelerator is available) take its CPU path instead of failing."""
    _warn_if_unusable()
    return _count() > 0 and not _C._in_bad_fork()


def is_initialized() -> bool:
    return _initialized and not _is_in_bad_fork()


def init() -> None:
    """Validate the configuration now rather than at the first use of the device (as torch.cuda.init)."""
    _lazy_init()


def _is_in_bad_fork() -> bool:
    """Whether this is a forked child of a parent that had used the device: device use raises here, as CUDA's does
    (PyTorch skips seeding such a device: a DataLoader worker's torch.manual_seed)."""
    return _C._in_bad_fork()


def _at_exit() -> None:
    """The exit-time drain (csrc/lifecycle.cpp): other threads' device use is refused, queued work gets at most
    TORCHNEURON_EXIT_TIMEOUT seconds, and a kernel error still pending is printed (as its sync point would raise
    it) and makes the exit status 1. A drain that times out names the busy streams and ends the process at once
    with status 1: the interpreter's teardown would run beside kernels still running."""
    if _C._in_bad_fork():  # the queues' state is the parent's, its errors too
        return
    timeout = _config.current().exit_timeout
    busy = _C._drain_for_exit(timeout)
    reported = _print_pending_errors()
    if busy:
        print(f"neuron: queued work did not finish within {timeout:g} s at exit (TORCHNEURON_EXIT_TIMEOUT) on "
              f"{', '.join(busy)}; the process ends now with status 1, without the rest of the interpreter's "
              "teardown", file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)
    if reported:
        _C._set_exit_status(1)


def _print_pending_errors() -> bool:
    """Print every kernel error still pending, each stream's oldest first (also those behind a drain that timed
    out: they are known already); whether there was one."""
    reported = set()
    k = 0
    while True:
        try:
            if not _C._raise_stream_error(k):
                break
            k += 1
        except Exception as e:  # noqa: BLE001  (any kernel's error, as its sync point raises it)
            text = "".join(traceback.format_exception_only(e))
            if text not in reported:
                reported.add(text)
                print(f"neuron: a queued kernel failed and its error was still pending at exit:\n{text}",
                      end="", file=sys.stderr)
    return bool(reported)


def _count() -> int:
    """The number of usable devices, without initialising or warning (for PyTorch's own calls, e.g. seeding)."""
    cfg = _config.current_or_none() if _registered else None
    return cfg.device_count if cfg else 0


def _warn_if_unusable() -> None:
    """One warning naming the configuration's error, as torch.cuda's "CUDA initialization: ..." warning."""
    global _warned
    if _registered and _config.error() and not _warned:
        _warned = True
        warnings.warn(f"neuron initialization: {_config.error()}", stacklevel=3)


def device_count() -> int:
    """0 (with one warning naming the error) when the configuration is invalid, as torch.cuda.device_count."""
    _warn_if_unusable()
    return _count()


def current_device() -> int:
    _lazy_init()
    return torch._C._accelerator_hooks_get_current_device()


def _index(device: _device_t, optional: bool = True) -> int:
    _lazy_init()
    if device is None:
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"expected a neuron device, got {device}")
        return current_device() if device.index is None else device.index
    if isinstance(device, int):
        return device
    raise TypeError(f"expected a neuron device (torch.device, str or int), got {type(device).__name__}")


def set_device(device: _device_t) -> None:
    idx = _index(device)
    if idx >= 0:
        torch._C._accelerator_hooks_set_current_device(idx)


class device:
    """Context manager that changes the current neuron device, like `torch.cuda.device`."""

    def __init__(self, device: _device_t):
        self.idx = _index(device)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = torch._C._accelerator_hooks_exchange_device(self.idx)

    def __exit__(self, *exc: Any) -> bool:
        torch._C._accelerator_hooks_set_current_device(self.prev)
        return False


class device_of(device):
    """Context manager that makes the device of a tensor current, like `torch.cuda.device_of`."""

    def __init__(self, obj: torch.Tensor):
        super().__init__(obj.get_device() if obj.is_neuron else -1)

    def __enter__(self) -> None:
        if self.idx >= 0:
            super().__enter__()

    def __exit__(self, *exc: Any) -> bool:
        return super().__exit__() if self.idx >= 0 else False


@dataclasses.dataclass(frozen=True)
class NeuronDeviceProperties:
    """What `get_device_properties` reports: the logical NeuronCore and the chip it belongs to."""

    name: str
    total_memory: int
    core_version: str
    logical_core: int  # global logical-core id on the instance
    physical_cores: int  # physical NeuronCores behind this logical core (the LNC setting)
    chip_index: int
    chip: str
    instance: str
    cores_per_chip: int

    @property
    def major(self) -> int:
        """The NeuronCore version (v2 on trn1, v3 on trn2, v4 on trn3): `get_device_capability`'s first number,
        under torch.cuda's attribute name (CUDA scripts gate features on `props.major`)."""
        return int(self.core_version.rsplit("v", 1)[1])

    @property
    def minor(self) -> int:
        return 0

    def __repr__(self) -> str:
        return (f"NeuronDeviceProperties(name='{self.name}', total_memory={self.total_memory >> 20}MB, "
                f"core={self.core_version}, logical_core={self.logical_core}, lnc={self.physical_cores}, "
                f"chip={self.chip_index} ({self.chip}), instance={self.instance})")


def _invalid_device_message(idx: int) -> str:
    return (f"neuron error: invalid device ordinal {idx}: this process sees {device_count()} neuron device(s), "
            f"valid indices are 0..{device_count() - 1} (see NEURON_RT_VISIBLE_CORES and TORCHNEURON_INSTANCE)")


def _checked(device: _device_t) -> int:
    """The device's index; an invalid one raises torch.AcceleratorError (a RuntimeError), as CUDA's calls do."""
    idx = _index(device)
    if not 0 <= idx < device_count():
        raise torch.AcceleratorError(_invalid_device_message(idx))
    return idx


def get_device_properties(device: _device_t = None) -> NeuronDeviceProperties:
    idx = _index(device)
    if not 0 <= idx < device_count():  # torch.cuda.get_device_properties raises AssertionError("Invalid device id")
        raise AssertionError(f"Invalid device id: {_invalid_device_message(idx)}")
    cfg = config()
    core = cfg.visible_cores[idx]
    return NeuronDeviceProperties(
        name=f"{cfg.chip.name} {cfg.chip.core_version} (modelled)", total_memory=cfg.core_capacity,
        core_version=cfg.chip.core_version, logical_core=core, physical_cores=cfg.lnc,
        chip_index=core // cfg.cores_per_chip, chip=cfg.chip.name, instance=cfg.instance.name,
        cores_per_chip=cfg.cores_per_chip)


def get_device_name(device: _device_t = None) -> str:
    return get_device_properties(device).name


def get_device_capability(device: _device_t = None) -> tuple[int, int]:
    """The NeuronCore version as (major, 0): v2 on trn1, v3 on trn2, v4 on trn3."""
    props = get_device_properties(device)  # validates the index as CUDA does
    return props.major, props.minor


def synchronize(device: _device_t = None) -> None:
    """Wait for all work queued on the device's streams; raises the error of a kernel that failed."""
    torch._C._accelerator_synchronizeDevice(_checked(device))


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float32, torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# The compiler's per-graph metrics: torchneuron.compiler.metrics registers its readers when it loads (at the first
# compile); until then nothing has compiled. The device layer does not import the compiler.
_metrics_get: Callable[[], list[dict]] = list
_metrics_reset: Callable[[], None] = lambda: None


def set_dynamo_metrics_source(get: Callable[[], list[dict]], reset: Callable[[], None]) -> None:
    global _metrics_get, _metrics_reset
    _metrics_get, _metrics_reset = get, reset


def get_dynamo_metrics() -> list[dict]:
    """Per-graph compile metrics of `torch.compile(backend="neuron")` (AWS TorchNeuron's name)."""
    return _metrics_get()


def reset_dynamo_metrics() -> None:
    _metrics_reset()
