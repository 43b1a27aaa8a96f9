"""`torch.neuron`: the device module of the neuron backend, with the names of `torch.cuda` and AWS TorchNeuron."""
import importlib

from . import memory, random, storage, streams  # noqa: F401  (torch.neuron.memory, ...)
from .memory import (  # noqa: F401
    empty_cache,
    get_per_process_memory_fraction,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_peak_memory_stats,
    set_per_process_memory_fraction,
)
from .module import (  # noqa: F401
    NeuronDeviceProperties,
    _is_in_bad_fork,
    _lazy_init,
    config,
    current_device,
    device,
    device_count,
    device_of,
    get_amp_supported_dtype,
    get_device_capability,
    get_device_name,
    get_device_properties,
    get_dynamo_metrics,
    init,
    is_available,
    is_bf16_supported,
    is_initialized,
    reset_dynamo_metrics,
    set_device,
    synchronize,
)
from .random import (  # noqa: F401
    default_generator,
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_rng_state,
    set_rng_state_all,
)
from .streams import (  # noqa: F401
    Event,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    query,
    record_event,
    set_stream,
    stream,
    wait_event,
    wait_stream,
)

globals().update(storage.LEGACY_STORAGES)  # torch.neuron.FloatStorage, ... (Tensor.storage_type() looks here)

# torch.utils.checkpoint saves and restores a device's RNG state only if its module says it is initialised (it
# reads torch.cuda._initialized); the modelled devices are ready at registration.
_initialized = True


def __getattr__(name: str):
    """torch.neuron.stream_check, and _gpu_trace (where PyTorch sends the device's GPU trace), load on first use."""
    if name in ("stream_check", "_gpu_trace"):
        stream_check = importlib.import_module(f"{__name__}.stream_check")  # sets the package's attribute
        globals()["_gpu_trace"] = stream_check._gpu_trace
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
