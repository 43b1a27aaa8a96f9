"""Registration and autoload: `neuron` exists after a bare `import torch`, with torch.cuda-like APIs."""
import torch
import torch.nn as nn
from conftest import run_py


def test_autoload_registers_without_import():
    p = run_py("import torch; t = torch.ones(2, device='neuron'); print(t.device, torch.neuron.is_available(), "
               "torch.accelerator.current_accelerator())")
    assert p.stdout.split() == ["neuron:0", "True", "neuron"]


def test_autoload_can_be_disabled():
    p = run_py("""
        import sys, torch
        print('torchneuron' in sys.modules, hasattr(torch, 'neuron'))
        try:
            torch.ones(1, device='neuron')
        except RuntimeError as e:
            print('error')
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert p.stdout.split() == ["False", "False", "error"]


def test_import_stays_light():
    p = run_py("""
        import sys, torch
        heavy = [m for m in ('torch._dynamo', 'torch._inductor', 'matplotlib', 'libcst', 'transformers')
                 if m in sys.modules]
        print(heavy)
    """)
    assert p.stdout.strip() == "[]"


def test_generated_methods_and_module():
    t = torch.arange(4.0).neuron()
    assert t.is_neuron and t.device == torch.device("neuron", 0)
    assert t.neuron(1).device == torch.device("neuron:1")
    m = nn.Linear(3, 2).neuron()
    assert m.weight.is_neuron and m.bias.is_neuron
    s = torch.ones(3).untyped_storage().neuron()
    assert s.is_neuron and s.device.type == "neuron"
    assert torch.device("neuron").type == "neuron"
    assert torch.get_device_module("neuron") is torch.neuron
    assert not torch.ones(1).is_neuron


def test_device_properties_follow_the_modelled_machine():
    props = torch.neuron.get_device_properties(0)
    assert torch.neuron.device_count() == 4  # trn2.3xlarge, LNC=2: 8 physical cores / 2
    assert props.total_memory == 24 * 2**30  # 96 GiB HBM per chip / 4 logical cores
    assert props.physical_cores == 2 and props.chip == "Trainium2" and props.core_version == "NeuronCore-v3"
    assert "Trainium2" in torch.neuron.get_device_name()
    assert torch.neuron.get_device_capability() == (3, 0)
    assert torch.neuron.get_amp_supported_dtype() == [torch.float32, torch.float16, torch.bfloat16]
    assert torch.neuron.is_bf16_supported()


def test_instance_and_core_configuration():
    code = "import torch; p = torch.neuron.get_device_properties(torch.neuron.device_count() - 1); " \
           "print(torch.neuron.device_count(), p.total_memory >> 30, p.logical_core, p.chip_index)"
    assert run_py(code, {"TORCHNEURON_INSTANCE": "trn2.48xlarge"}).stdout.split() == ["64", "24", "63", "15"]
    assert run_py(code, {"TORCHNEURON_INSTANCE": "trn2.48xlarge", "NEURON_LOGICAL_NC_CONFIG": "1",
                         "NEURON_RT_VISIBLE_CORES": "0-7"}).stdout.split() == ["8", "12", "7", "0"]
    assert run_py(code, {"TORCHNEURON_INSTANCE": "trn1.32xlarge"}).stdout.split() == ["32", "16", "31", "15"]
    assert run_py(code, {"NEURON_RT_VISIBLE_CORES": "1,3"}).stdout.split() == ["2", "24", "3", "0"]
    assert run_py(code, {"TORCHNEURON_MEMORY_LIMIT": "512MiB"}).stdout.split()[1] == "0"
    assert run_py(code, {"TORCHNEURON_INSTANCE": "trn3.48xlarge"}).stdout.split() == ["64", "36", "63", "15"]


def test_bad_configuration_is_a_clear_error():
    for env, needle in [({"TORCHNEURON_INSTANCE": "p5.48xlarge"}, "not a modelled instance"),
                        ({"NEURON_LOGICAL_NC_CONFIG": "3"}, "not valid on Trainium2"),
                        ({"NEURON_RT_VISIBLE_CORES": "9"}, "logical cores 0-3"),
                        ({"TORCHNEURON_MEMORY_LIMIT": "lots"}, "cannot read a size"),
                        ({"TORCHNEURON_INSTANCE": "trn2.48xlarge", "NEURON_LOGICAL_NC_CONFIG": "1"}, "127"),
                        ({"TORCHNEURON_DTYPE_POLICY": "fast"}, "choose one of")]:
        p = run_py("import torch", env, check=False)
        assert p.returncode != 0 and needle in p.stderr, (env, p.stderr[-500:])
