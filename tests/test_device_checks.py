"""ATen kernels that check the device type (found by searching ATen's sources), and invalid device indices raising
CUDA's exception types."""
import pytest
import torch


@pytest.mark.parametrize("keepdim", [False, True])
def test_mode_out_matches_cpu(keepdim):
    """ATen's mode.values refuses devices other than CPU/CUDA/XPU; on neuron it runs the CPU's composite."""
    x = torch.randint(0, 4, (5, 7)).float()
    ref = torch.mode(x, 1, keepdim)
    for shaped in (True, False):  # into correctly shaped outputs, and into empty ones it must resize
        shape = ref.values.shape if shaped else (0,)
        vals = torch.empty(shape, device="neuron")
        idx = torch.empty(shape, dtype=torch.long, device="neuron")
        res = torch.mode(x.to("neuron"), 1, keepdim, out=(vals, idx))
        assert res.values is vals and res.indices is idx
        assert torch.equal(vals.cpu(), ref.values) and torch.equal(idx.cpu(), ref.indices)


INVALID = {  # what torch.cuda raises for the same call: AcceleratorError ("invalid device ordinal", a RuntimeError)
    "tensor creation": lambda: torch.empty(2, device="neuron:99"),
    "to": lambda: torch.ones(2).to("neuron:99"),
    "set_device": lambda: torch.neuron.set_device(99),
    "device context": lambda: torch.neuron.device(99).__enter__(),
    "accelerator.set_device_index": lambda: torch.accelerator.set_device_index(99),
    "Stream": lambda: torch.neuron.Stream(99),
    "torch.Stream": lambda: torch.Stream(device="neuron:99"),
    "synchronize": lambda: torch.neuron.synchronize(99),
    "memory_allocated": lambda: torch.neuron.memory_allocated(99),
    "memory_stats": lambda: torch.neuron.memory_stats(99),
    "mem_get_info": lambda: torch.neuron.mem_get_info(99),
    "reset_peak_memory_stats": lambda: torch.neuron.reset_peak_memory_stats(99),
}


@pytest.mark.parametrize("call", INVALID)
def test_invalid_device_index_raises_like_cuda(call):
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal 99.*valid indices are 0..3"):
        INVALID[call]()
    assert torch.neuron.current_device() == 0


@pytest.mark.parametrize("fn", ["get_device_properties", "get_device_name", "get_device_capability"])
def test_invalid_device_properties_raise_assertion_like_cuda(fn):
    with pytest.raises(AssertionError, match="Invalid device id"):  # torch.cuda.get_device_properties's type
        getattr(torch.neuron, fn)(99)
