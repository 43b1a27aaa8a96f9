"""torch.accelerator with `neuron` as the current accelerator."""
import torch


def test_device_selection():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.device_count() == torch.neuron.device_count() == 4
    torch.accelerator.set_device_index(2)
    assert torch.accelerator.current_device_index() == 2 == torch.neuron.current_device()
    assert torch.ones(1, device="neuron").device == torch.device("neuron:2")
    with torch.accelerator.device_index(1):
        assert torch.neuron.current_device() == 1
    assert torch.neuron.current_device() == 2


def test_memory_apis():
    torch.accelerator.empty_cache()
    base = torch.accelerator.memory_allocated()
    t = torch.empty(1 << 20, dtype=torch.uint8, device="neuron")
    assert torch.accelerator.memory_allocated() == base + (1 << 20)
    assert torch.accelerator.max_memory_allocated() >= base + (1 << 20)
    assert torch.accelerator.memory_reserved() >= torch.accelerator.memory_allocated()
    assert torch.accelerator.memory_stats()["allocated_bytes.all.current"] == base + (1 << 20)
    torch.accelerator.reset_peak_memory_stats()
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.accelerator.memory_stats()["allocated_bytes.all.allocated"] == 0
    del t
    free, total = torch.accelerator.get_memory_info()
    assert total == 24 << 30 and 0 < free <= total


def test_synchronize_streams_and_events():
    torch.accelerator.synchronize()
    torch.accelerator.synchronize(1)
    s = torch.Stream(device="neuron")
    torch.accelerator.set_stream(s)
    assert torch.accelerator.current_stream() == s
    e = torch.Event(device="neuron", enable_timing=True)
    e.record(s)
    assert e.query()
    torch.accelerator.set_stream(torch.neuron.default_stream())


def test_device_agnostic_training_loop():
    dev = torch.accelerator.current_accelerator()
    m = torch.nn.Linear(3, 1).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        loss = m(torch.randn(4, 3, device=dev)).float().pow(2).mean()
    loss.backward()
    opt.step()
    torch.accelerator.synchronize()
    assert m.weight.device.type == "neuron"
