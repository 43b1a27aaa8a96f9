"""torch.save / torch.load of neuron tensors and modules, with every map_location form."""
import io
import warnings

import pytest
import torch
import torch.nn as nn


def roundtrip(obj, **kw):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **kw)


def test_default_load_restores_the_device():
    t = torch.randn(3, 4, device="neuron:1")
    back = roundtrip(t)
    assert back.device == torch.device("neuron:1") and torch.equal(back.cpu(), t.cpu())


@pytest.mark.parametrize("loc,expected", [
    ("cpu", "cpu"), ("neuron", "neuron:0"), ("neuron:1", "neuron:1"), (torch.device("neuron:2"), "neuron:2"),
    ({"neuron:1": "neuron:3"}, "neuron:3")])
def test_map_location(loc, expected):
    sd = nn.Linear(4, 3).to("neuron:1").state_dict()
    back = roundtrip(sd, map_location=loc)
    for k, v in back.items():
        assert str(v.device) == expected and torch.equal(v.cpu(), sd[k].cpu())


def test_cpu_checkpoint_to_device_and_views_share_storage():
    base = torch.arange(10.0)
    obj = {"a": base, "b": base[2:5]}
    back = roundtrip(obj, map_location="neuron")
    assert back["b"].is_neuron
    back["a"][3] = 100.0
    assert back["b"][1].item() == 100.0  # the view still aliases its base after loading


def test_absent_device_is_a_clear_error():
    t = torch.ones(2, device="neuron")
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    with pytest.raises(RuntimeError, match="neuron"):
        torch.load(buf, map_location="neuron:9")
    assert (torch.ones(2, device="neuron") + 1).sum().item() == 4  # still working


def test_module_and_optimizer_checkpoint_resume():
    torch.manual_seed(0)
    m = nn.Linear(4, 2).neuron()
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(3, 4, device="neuron")).sum().backward()
    opt.step()
    ck = roundtrip({"model": m.state_dict(), "opt": opt.state_dict(), "rng": torch.neuron.get_rng_state()})
    m2 = nn.Linear(4, 2).neuron()
    m2.load_state_dict(ck["model"])
    opt2 = torch.optim.Adam(m2.parameters())
    opt2.load_state_dict(ck["opt"])
    assert opt2.state_dict()["state"][0]["exp_avg"].is_neuron
    assert torch.equal(m2.weight.cpu(), m.weight.cpu())


def test_untyped_storage_on_device():
    s = torch.UntypedStorage(16, device="neuron:1")
    assert s.device == torch.device("neuron:1") and s.nbytes() == 16
    s.resize_(64)
    assert s.nbytes() == 64


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_checkpoint_loaded_onto_the_device_is_held_to_the_dtype_rules(weights_only):
    """torch.load moves storages as raw bytes; the tensors rebuilt on the device get what `.to("neuron")` gives:
    float64 values rounded to float32 precision (also through a view and an expanded tensor over one storage),
    int64 outside the int32 range warned and counted."""
    import torchneuron

    d = torch.tensor([1 + 1e-12, 3.0], dtype=torch.float64)
    obj = {"d": d, "view": d[1:], "wide": torch.tensor([2**40, 1]), "expanded": d[:1].expand(3)}
    key = "aten::copy_ (host to neuron)"  # what `.to("neuron")` counts (warned once per process)
    before = torchneuron.get_dtype_events().get(key, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = roundtrip(obj, map_location="neuron", weights_only=weights_only)
    assert torchneuron.get_dtype_events().get(key, 0) - before == 4  # each tensor, as `.to` would count it
    moved = d.to("neuron")
    assert torch.equal(back["d"].cpu(), moved.cpu()) and back["d"].cpu()[0].item() == 1.0  # not 1 + 1e-12
    assert torch.equal(back["view"].cpu(), moved[1:].cpu())
    assert torch.equal(back["expanded"].cpu(), moved[:1].expand(3).cpu())
    assert torch.equal(back["wide"].cpu(), obj["wide"])  # kept exactly (host memory), but reported
