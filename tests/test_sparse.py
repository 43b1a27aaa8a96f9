"""Sparse COO tensors on neuron: ATen's sparse tensors over device memory, every op the CPU's sparse kernel. Each
result is compared with the same computation on the CPU."""
import pytest
import torch
import torch.nn.functional as F

N = "neuron"


def _coo(n=6, m=5, nnz=9, seed=0, coalesced=False):
    g = torch.Generator().manual_seed(seed)
    i = torch.stack([torch.randint(0, n, (nnz,), generator=g), torch.randint(0, m, (nnz,), generator=g)])
    s = torch.sparse_coo_tensor(i, torch.randn(nnz, generator=g), (n, m))
    return s.coalesce() if coalesced else s


def test_construct_move_and_read_back():
    s = _coo()
    d = s.to(N)
    assert d.is_sparse and d.device.type == N and d.layout == torch.sparse_coo and d.shape == s.shape
    assert d._indices().device.type == N and d._values().device.type == N and d._nnz() == s._nnz()
    assert torch.equal(d.to_dense().cpu(), s.to_dense())
    assert torch.equal(d.cpu().to_dense(), s.to_dense()) and d.cpu().device.type == "cpu"
    made = torch.sparse_coo_tensor(s._indices(), s._values(), s.shape, device=N)
    assert made.device.type == N and torch.equal(made.to_dense().cpu(), s.to_dense())
    dense = torch.randn(4, 3)
    dense[dense < 0.3] = 0
    assert torch.equal(dense.to(N).to_sparse().to_dense().cpu(), dense)
    assert torch.equal(dense.to(N).to_sparse(1).to_dense().cpu(), dense.to_sparse(1).to_dense())


def test_coalesce_matches_the_cpu():
    s = _coo(nnz=20)
    c, dc = s.coalesce(), s.to(N).coalesce()
    assert dc.is_coalesced() and dc.device.type == N
    assert torch.equal(dc._indices().cpu(), c._indices()) and torch.equal(dc._values().cpu(), c._values())


@pytest.mark.parametrize("fn", [torch.sparse.mm, torch.mm, torch.spmm if hasattr(torch, "spmm") else torch.mm,
                                lambda a, b: a @ b])
def test_sparse_times_dense_matches_the_cpu(fn):
    s, x = _coo(coalesced=True), torch.randn(5, 3)
    torch.testing.assert_close(fn(s.to(N), x.to(N)).cpu(), fn(s, x))


def test_gcn_layer_forward_and_backward_match_the_cpu():
    """pytorch/examples' GCN: a sparse normalised adjacency on the device, dense features and weights."""
    torch.manual_seed(0)
    adj, feats = _coo(8, 8, 24, coalesced=True), torch.randn(8, 5)
    w1, w2 = torch.randn(5, 6), torch.randn(6, 3)
    labels = torch.randint(0, 3, (8,))

    def step(device):
        a, x = adj.to(device), feats.to(device).requires_grad_()
        p1, p2 = w1.to(device).requires_grad_(), w2.to(device).requires_grad_()
        h = F.relu(torch.sparse.mm(a, x @ p1))
        loss = F.cross_entropy(torch.sparse.mm(a, h @ p2), labels.to(device))
        loss.backward()
        return [t.detach().cpu() for t in (loss, x.grad, p1.grad, p2.grad)]

    for got, want in zip(step(N), step("cpu"), strict=True):
        torch.testing.assert_close(got, want)


def test_gradient_with_respect_to_sparse_values_matches_the_cpu():
    s, x = _coo(coalesced=True), torch.randn(5, 3)

    def grads(device):
        a = s.to(device).requires_grad_()
        torch.sparse.mm(a, x.to(device)).sum().backward()
        return a.grad.to_dense().cpu()

    torch.testing.assert_close(grads(N), grads("cpu"))


def test_sparse_arithmetic_and_in_place_ops_match_the_cpu():
    a, b = _coo(seed=1), _coo(seed=2)
    da, db = a.to(N), b.to(N)
    torch.testing.assert_close((da + db).to_dense().cpu(), (a + b).to_dense())
    torch.testing.assert_close((da * 2).to_dense().cpu(), (a * 2).to_dense())
    torch.testing.assert_close(torch.sparse.sum(da).cpu(), torch.sparse.sum(a))
    torch.testing.assert_close(da.t().to_dense().cpu(), a.t().to_dense())
    da.add_(db)
    a.add_(b)
    assert da.device.type == N and torch.equal(da.to_dense().cpu(), a.to_dense())
    dense, ddense = torch.zeros(6, 5), torch.zeros(6, 5, device=N)
    ddense.add_(db)
    dense.add_(b)
    assert torch.equal(ddense.cpu(), dense)


def test_compressed_layouts_stay_refused():
    with pytest.raises(NotImplementedError, match="neuron"):
        _coo(coalesced=True).to_sparse_csr().to(N)
    with pytest.raises(NotImplementedError, match="neuron"):
        torch.ones(2, 2, device=N).to_sparse_csr()
