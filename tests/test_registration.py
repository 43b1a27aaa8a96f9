"""Registration and autoload: `neuron` exists after a bare `import torch`, with torch.cuda-like APIs."""
import textwrap

import pytest
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


BAD_CONFIGURATIONS = [({"TORCHNEURON_INSTANCE": "p5.48xlarge"}, "not a modelled instance"),
                      ({"NEURON_LOGICAL_NC_CONFIG": "3"}, "not valid on Trainium2"),
                      ({"NEURON_RT_VISIBLE_CORES": "9"}, "logical cores 0-3"),
                      ({"TORCHNEURON_MEMORY_LIMIT": "lots"}, "cannot read a size"),
                      ({"TORCHNEURON_INSTANCE": "trn2.48xlarge", "NEURON_LOGICAL_NC_CONFIG": "1"}, "127"),
                      ({"TORCHNEURON_DTYPE_POLICY": "fast"}, "choose one of"),
                      ({"TORCHNEURON_FALLBACK": "loud"}, "choose one of")]

# Every first use of the device, each in its own try: prints the exception type and whether the message is there.
FIRST_USES = """
    import sys, torch
    needle = sys.argv[1]
    x = torch.ones(3) * 2  # CPU work is unaffected
    torch.manual_seed(0)  # seeds every device generator, as in any program
    print("cpu", x.sum().item())
    uses = {
        "empty": lambda: torch.empty(2, device="neuron"),
        "to": lambda: x.to("neuron"),
        "method": lambda: x.neuron(),
        "tensor": lambda: torch.tensor([1.0], device="neuron"),
        "module": lambda: torch.nn.Linear(2, 2).to("neuron"),
        "current_device": lambda: torch.neuron.current_device(),
        "properties": lambda: torch.neuron.get_device_properties(0),
        "memory": lambda: torch.neuron.memory_allocated(),
        "config": lambda: torch.neuron.config(),
        "init": lambda: torch.neuron.init(),
        "accelerator": lambda: torch.accelerator.set_device_index(0),
        "accelerator_index": lambda: torch.accelerator.current_device_index(),
        "compile": lambda: torch.compile(lambda: torch.ones(2, device="neuron") * 2, backend="neuron")(),
    }
    for name, use in uses.items():
        try:
            use()
            print(name, "ok")
        except Exception as e:
            print(name, isinstance(e, RuntimeError), needle in str(e))  # compile: Dynamo's RuntimeError subclasses
"""


def _first_uses(env: dict, needle: str) -> dict:
    p = run_py(f"import sys; sys.argv = ['x', {needle!r}]\n" + textwrap.dedent(FIRST_USES), env)
    lines = dict(line.split(" ", 1) for line in p.stdout.strip().splitlines())
    assert lines.pop("cpu") == "6.0", p.stdout
    return lines


def _check_first_uses(uses: dict) -> None:
    assert uses.pop("memory") == "ok"  # statistics before initialisation are empty, as torch.cuda's
    assert set(uses.values()) == {"True True"}, uses


def test_bad_configuration_fails_at_first_device_use_not_at_import():
    """`import torch` and CPU work never fail on the environment (as CUDA: a broken setup fails at CUDA's lazy
    initialisation); every first use of `neuron` raises a RuntimeError with the configuration's message."""
    from torchneuron.hardware import config

    for env, needle in BAD_CONFIGURATIONS:  # the message each variable gets (what the first use raises)
        with pytest.raises(config.ConfigError, match=needle):
            config.load(env)
    _check_first_uses(_first_uses(*BAD_CONFIGURATIONS[0]))
    p = run_py("import torch; print(torch.ones(2).sum().item())\ntry:\n  torch.ones(1).neuron()\n"
               "except RuntimeError as e:\n  print('logical cores 0-3' in str(e))", BAD_CONFIGURATIONS[2][0])
    assert p.stdout.split() == ["2.0", "True"] and not p.stderr.strip(), p.stderr[-800:]


def test_bad_configuration_reports_no_device_like_cuda():
    """is_available() never raises and is False, device_count() is 0 with one warning naming the error (what
    torch.cuda does when its driver cannot initialise); torch.accelerator agrees."""
    p = run_py("""
        import warnings, torch
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            print(torch.neuron.is_available(), torch.neuron.device_count(), torch.accelerator.is_available(),
                  torch.accelerator.device_count(), torch.neuron.is_initialized())
        print(len(w), "not a modelled instance" in str(w[0].message))
    """, {"TORCHNEURON_INSTANCE": "p5.48xlarge"})
    assert p.stdout.split() == ["False", "0", "False", "0", "False", "1", "True"], p.stdout


def test_local_rank_beyond_the_visible_cores_fails_only_when_that_rank_uses_neuron():
    """A CPU-only `torchrun --nproc-per-node=5` job on a 4-core machine: rank 4 imports torch and trains on the
    CPU; only a use of neuron raises, naming LOCAL_RANK."""
    env = {"LOCAL_RANK": "4"}
    _check_first_uses(_first_uses(env, "LOCAL_RANK=4 but this process sees only 4 neuron core(s)"))
    # torch.distributed's default backend (no backend named: PyTorch picks the accelerator's, `neuron`, whose
    # group carries CPU tensors too) works on that rank
    p = run_py("""
        import torch, torch.distributed as dist
        print(torch.neuron.is_available(), torch.neuron.device_count())
        dist.init_process_group(init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        t = torch.ones(3)
        dist.all_reduce(t)
        print(t.tolist() == [1.0, 1.0, 1.0], dist.get_backend_config())
        dist.destroy_process_group()
    """, env)
    assert p.stdout.split() == ["True", "4", "True", "neuron:neuron"], p.stdout
    # A valid LOCAL_RANK makes that core the current device; lazy validation passes.
    p = run_py("import torch; print(torch.ones(1, device='neuron').device, torch.neuron.current_device(), "
               "torch.neuron.is_initialized())", {"LOCAL_RANK": "2"})
    assert p.stdout.split() == ["neuron:2", "2", "True"]


def test_module_conversion_keeps_parameters_with_weakrefs_and_ties():
    """`Module.to("neuron")` converts parameters in place as CUDA does: identity, tying and optimizers built
    before the move survive, and weak references (which torch.utils.swap_tensors refuses) do not break it."""
    import weakref

    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = nn.Sequential(emb, nn.Linear(4, 4), head)
    ref_model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
    ref_model.load_state_dict(model.state_dict())
    ref_model[2].weight = ref_model[0].weight
    params = list(model.parameters())
    refs = [weakref.ref(p) for p in params]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: optimizer state is not moved, as on CUDA
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def step(m, o, x):
        o.zero_grad()
        loss = m(x).logsumexp(-1).mean()
        loss.backward()
        o.step()
        return loss

    step(model, opt, ids)  # gradients exist on the CPU before the move
    step(ref_model, ref_opt, ids)
    assert model.to("neuron") is model
    assert [r() for r in refs] == params and list(model.parameters()) == params
    assert all(p.is_neuron and p.grad.is_neuron and isinstance(p, nn.Parameter) for p in params)
    assert model[2].weight is model[0].weight
    assert opt.param_groups[0]["params"] == params
    for _ in range(2):  # the optimizer built before the move updates the moved parameters
        loss = step(model, opt, ids.to("neuron"))
        ref_loss = step(ref_model, ref_opt, ids)
    torch.testing.assert_close(loss.cpu(), ref_loss)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q)
    model.cpu()
    assert [r() for r in refs] == params and all(p.device.type == "cpu" for p in params)
    # an autograd graph still holds the weight: torch.utils.swap_tensors would refuse, in place it converts
    lin = nn.Linear(2, 2)
    keep = (lin.weight ** 2).sum()  # the graph saves the weight itself
    lin.to("neuron")
    assert lin.weight.is_neuron and keep.grad_fn is not None
