"""The device allocator: CUDA-style statistics, caching, capacity and out-of-memory."""
import gc

import pytest
import torch
from conftest import run_py

MiB = 1 << 20


def test_allocated_tracks_tensors_exactly():
    torch.neuron.empty_cache()
    base = torch.neuron.memory_allocated()
    t = torch.empty(MiB, dtype=torch.uint8, device="neuron")
    assert torch.neuron.memory_allocated() - base == MiB
    assert torch.neuron.memory_reserved() >= torch.neuron.memory_allocated()
    del t
    assert torch.neuron.memory_allocated() == base


def test_freed_blocks_stay_cached_until_empty_cache():
    gc.collect()  # earlier tests' garbage freed mid-test would change what is reserved
    torch.neuron.synchronize()
    torch.neuron.empty_cache()
    t = torch.empty(3 * MiB, dtype=torch.uint8, device="neuron")
    reserved = torch.neuron.memory_reserved()
    del t
    assert torch.neuron.memory_reserved() == reserved  # cached, like CUDA
    again = torch.empty(3 * MiB, dtype=torch.uint8, device="neuron")  # reuses the block: no new segment
    assert torch.neuron.memory_reserved() == reserved
    del again
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() == reserved - 3 * MiB


def test_stats_and_peaks():
    torch.neuron.empty_cache()
    torch.neuron.reset_peak_memory_stats()
    base = torch.neuron.memory_allocated()
    a = torch.empty(2 * MiB, dtype=torch.uint8, device="neuron")
    b = torch.empty(MiB, dtype=torch.uint8, device="neuron")
    del a
    stats = torch.neuron.memory_stats()
    assert torch.neuron.max_memory_allocated() == base + 3 * MiB
    assert stats["allocated_bytes.all.current"] == base + MiB
    assert stats["allocated_bytes.small_pool.current"] >= MiB  # blocks up to 1 MiB are "small", like CUDA
    assert stats["requested_bytes.all.current"] >= MiB
    assert stats["allocation.all.current"] >= 1 and stats["segment.all.current"] >= 1
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()
    assert torch.accelerator.memory_allocated(0) == torch.neuron.memory_allocated(0)
    del b


def test_small_sizes_round_like_cuda():
    base = torch.neuron.memory_allocated()
    t = torch.empty(3, dtype=torch.float32, device="neuron")
    assert torch.neuron.memory_allocated() - base == 512
    assert torch.neuron.memory_stats()["requested_bytes.all.current"] >= 12
    del t


def test_per_device_accounting():
    base0, base1 = torch.neuron.memory_allocated(0), torch.neuron.memory_allocated(1)
    t = torch.empty(MiB, dtype=torch.uint8, device="neuron:1")
    assert torch.neuron.memory_allocated(1) - base1 == MiB and torch.neuron.memory_allocated(0) == base0
    del t


def test_threads_allocating_on_two_devices_keep_exact_accounting():
    """Each device has its own allocator lock: two threads allocating and freeing on two devices at once (results
    of kernels, adopted host memory, plain allocations) leave each device's counts exact, and every value right."""
    import threading

    base = [torch.neuron.memory_allocated(d) for d in (0, 1)]
    errors = []

    def churn(dev: int) -> None:
        try:
            x = torch.arange(1000, dtype=torch.float32, device=f"neuron:{dev}")
            for i in range(300):
                y = torch.empty(100 + i, device=f"neuron:{dev}")  # allocated
                z = (x * 2).sum() + i  # kernel results, queued or inline
                w = torch.linalg.qr(x[:16].view(4, 4)).Q  # a host fallback: its result memory is adopted
                assert z.item() == 999000 + i and w.shape == (4, 4)
                del y, z, w
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.neuron.synchronize()
    assert not errors, errors
    assert [torch.neuron.memory_allocated(d) for d in (0, 1)] == base


def test_results_of_ops_are_device_memory():
    x = torch.randn(256, 256, device="neuron")
    base = torch.neuron.memory_allocated()
    y = x @ x  # produced by a CPU kernel, adopted into device memory without a copy
    z = torch.linalg.qr(x).Q  # a host-fallback op
    assert y.is_neuron and z.is_neuron
    assert torch.neuron.memory_allocated() - base >= 2 * 256 * 256 * 4
    del y, z
    assert torch.neuron.memory_allocated() == base


def test_mem_get_info_and_summary():
    free, total = torch.neuron.mem_get_info()
    assert total == torch.neuron.get_device_properties().total_memory
    assert free == total - torch.neuron.memory_reserved()
    assert torch.accelerator.get_memory_info(0) == (free, total)
    summary = torch.neuron.memory_summary()
    assert "Allocated memory" in summary and "neuron:0" in summary


def test_out_of_memory_is_clear_and_recoverable():
    p = run_py("""
        import torch
        keep = torch.empty(200 << 20, dtype=torch.uint8, device="neuron")
        try:
            torch.empty(400 << 20, dtype=torch.uint8, device="neuron")
        except torch.OutOfMemoryError as e:
            print("OOM", e)
        x = torch.ones(10, device="neuron") * 2  # the process keeps working
        print(x.sum().item(), torch.neuron.memory_stats()["num_ooms"])
    """, env={"TORCHNEURON_MEMORY_LIMIT": "512MiB"})
    out = p.stdout
    assert "OOM neuron:0 out of memory: tried to allocate 400.00 MiB" in out
    assert "capacity of 512.00 MiB" in out and "200.00 MiB is allocated" in out
    assert out.strip().endswith("20.0 1")


def test_cache_is_released_before_reporting_oom():
    p = run_py("""
        import torch
        a = torch.empty(300 << 20, dtype=torch.uint8, device="neuron"); del a   # cached, still reserved
        b = torch.empty(400 << 20, dtype=torch.uint8, device="neuron")          # fits once the cache is freed
        s = torch.neuron.memory_stats()
        print(s["num_alloc_retries"], s["num_ooms"], torch.neuron.memory_reserved() >> 20)
    """, env={"TORCHNEURON_MEMORY_LIMIT": "512MiB"})
    assert p.stdout.split() == ["1", "0", "400"]


def test_capacity_counts_op_outputs():
    p = run_py("""
        import torch
        x = torch.ones(60 << 20, dtype=torch.uint8, device="neuron")
        try:
            y = torch.cat([x, x])  # a kernel output that does not fit
        except torch.OutOfMemoryError as e:
            print("OOM")
    """, env={"TORCHNEURON_MEMORY_LIMIT": "100MiB"})
    assert p.stdout.strip() == "OOM"


def test_invalid_device_for_memory_api():
    with pytest.raises((IndexError, RuntimeError), match="device"):
        torch.neuron.memory_allocated(9)
