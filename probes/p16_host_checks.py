"""Host-checkable errors raise at the call while work is queued, with the CPU's exception type; the queued work and
later ops are unaffected. Each case runs twice first with valid arguments of the same shapes where possible, so the
signature is known and the op would queue."""
import torch
import torch.nn.functional as F
from _pc import DEV, check, done, drain, slow


def T(*s, dt=torch.float32, dev="cpu"):
    return torch.randn(*s).to(dt).to(dev) if dt.is_floating_point else torch.randint(0, 3, s, dtype=dt, device=dev)

CASES = {
    # name: (warm fn(dev) or None, failing fn(dev))
    "add broadcast": (lambda d: T(1024, 256, dev=d) + T(1024, 256, dev=d), lambda d: T(1024, 256, dev=d) + T(1024, 255, dev=d)),
    "add_ broadcast into smaller": (lambda d: T(1024, 256, dev=d).add_(T(1, 256, dev=d)), lambda d: T(1, 256, dev=d).add_(T(1024, 256, dev=d))),
    "int add_ float": (lambda d: T(1024, 256, dt=torch.int32, dev=d).add_(T(1024, 256, dt=torch.int32, dev=d)), lambda d: T(1024, 256, dt=torch.int32, dev=d).add_(T(1024, 256, dev=d))),
    "mm shape": (lambda d: T(256, 128, dev=d) @ T(128, 64, dev=d), lambda d: T(256, 128, dev=d) @ T(127, 64, dev=d)),
    "mm dtype": (None, lambda d: T(256, 128, dev=d) @ T(128, 64, dt=torch.float64, dev=d)),
    "bmm shape": (lambda d: torch.bmm(T(4, 256, 128, dev=d), T(4, 128, 64, dev=d)), lambda d: torch.bmm(T(4, 256, 128, dev=d), T(3, 128, 64, dev=d))),
    "cat shapes": (lambda d: torch.cat([T(256, 128, dev=d), T(256, 128, dev=d)]), lambda d: torch.cat([T(256, 128, dev=d), T(256, 127, dev=d)])),
    "device mix": (None, lambda d: T(1024, 256, dev=d) + T(1024, 256)),
    "out dtype": (lambda d: torch.add(T(1024, 256, dev=d), 1, out=T(1024, 256, dev=d)), lambda d: torch.add(T(1024, 256, dev=d), 1, out=T(1024, 256, dt=torch.int64, dev=d))),
    "out partial overlap": (lambda d: (lambda v: torch.add(v[:-1], 1, out=T(1023, 256, dev=d)))(T(1024, 256, dev=d)),
                            lambda d: (lambda v: torch.add(v[:-1], 1, out=v[1:]))(T(1024, 256, dev=d))),
    "mul_ self overlap expand": (None, lambda d: T(1, 256, dev=d).expand(1024, 256).mul_(2)),
    "view non-contig": (None, lambda d: T(256, 1024, dev=d).t().view(-1)),
    "index_put shape": (lambda d: T(1024, 256, dev=d).index_put_((torch.arange(4, device=d),), T(4, 256, dev=d)),
                        lambda d: T(1024, 256, dev=d).index_put_((torch.arange(4, device=d),), T(5, 256, dev=d))),
    "masked_fill_ mask dtype": (lambda d: T(1024, 256, dev=d).masked_fill_(T(1024, 256, dev=d) > 0, 1.0), lambda d: T(1024, 256, dev=d).masked_fill_(T(1024, 256, dt=torch.int64, dev=d), 1.0)),
    "linear shape": (lambda d: F.linear(T(64, 512, dev=d), T(256, 512, dev=d)), lambda d: F.linear(T(64, 512, dev=d), T(256, 511, dev=d))),
    "conv2d channels": (lambda d: F.conv2d(T(2, 3, 64, 64, dev=d), T(8, 3, 3, 3, dev=d)), lambda d: F.conv2d(T(2, 3, 64, 64, dev=d), T(8, 4, 3, 3, dev=d))),
    "sdpa shapes": (lambda d: F.scaled_dot_product_attention(T(2, 4, 128, 64, dev=d), T(2, 4, 128, 64, dev=d), T(2, 4, 128, 64, dev=d)),
                    lambda d: F.scaled_dot_product_attention(T(2, 4, 128, 64, dev=d), T(2, 4, 128, 32, dev=d), T(2, 4, 128, 64, dev=d))),
    "layer_norm shape": (lambda d: F.layer_norm(T(64, 512, dev=d), (512,)), lambda d: F.layer_norm(T(64, 512, dev=d), (511,))),
    "cross_entropy shapes": (lambda d: F.cross_entropy(T(64, 10, dev=d), torch.zeros(64, dtype=torch.long, device=d)), lambda d: F.cross_entropy(T(64, 10, dev=d), torch.zeros(63, dtype=torch.long, device=d))),
    "copy_ broadcast": (lambda d: T(1024, 256, dev=d).copy_(T(1024, 256, dev=d)), lambda d: T(1024, 256, dev=d).copy_(T(1024, 255, dev=d))),
    "copy_ from cpu broadcast": (lambda d: T(1024, 256, dev=d).copy_(T(1024, 256)), lambda d: T(1024, 256, dev=d).copy_(T(3, 256))),
    "copy_ overlap": (None, lambda d: (lambda v: v[1:].copy_(v[:-1]))(T(1024 * 256, dev=d))),
    "foreach add lists": (lambda d: torch._foreach_add([T(512, 512, dev=d)] * 2, [T(512, 512, dev=d)] * 2), lambda d: torch._foreach_add([T(512, 512, dev=d)] * 2, [T(512, 512, dev=d)] * 3)),
    "foreach add shapes": (lambda d: torch._foreach_add_([T(512, 512, dev=d)] * 2, [T(512, 512, dev=d)] * 2), lambda d: torch._foreach_add_([T(512, 512, dev=d)] * 2, [T(512, 511, dev=d)] * 2)),
    "where shapes": (lambda d: torch.where(T(1024, 256, dev=d) > 0, T(1024, 256, dev=d), 0.0), lambda d: torch.where(T(1024, 256, dev=d) > 0, T(1023, 256, dev=d), 0.0)),
    "gather dims": (lambda d: torch.gather(T(1024, 256, dev=d), 1, torch.zeros(1024, 4, dtype=torch.long, device=d)), lambda d: torch.gather(T(1024, 256, dev=d), 1, torch.zeros(1024, 4, 2, dtype=torch.long, device=d))),
    "scatter_ index dtype": (lambda d: T(1024, 256, dev=d).scatter_(1, torch.zeros(1024, 4, dtype=torch.long, device=d), 1.0), lambda d: T(1024, 256, dev=d).scatter_(1, torch.zeros(1024, 4, dtype=torch.int32, device=d), 1.0)),
    "requires_grad leaf inplace": (None, lambda d: T(1024, 256, dev=d).requires_grad_().add_(1)),
    "embedding index dtype": (None, lambda d: F.embedding(torch.zeros(64, dtype=torch.float32, device=d), T(10, 256, dev=d))),
}

for name, (warm, bad) in CASES.items():
    try:
        bad("cpu"); cpu_exc = None
    except Exception as ex:  # noqa: BLE001
        cpu_exc = ex
    if warm is not None:
        for _ in range(2):
            try:
                warm(DEV)
            except Exception as ex:  # noqa: BLE001
                print(f"  (warm {name} raised {type(ex).__name__}: {str(ex)[:80]})")
    torch.neuron.synchronize()
    slow()
    y = torch.ones(1024, 1024, device=DEV) * 3
    try:
        r = bad(DEV); got = None
    except Exception as ex:  # noqa: BLE001
        got = ex
    if name == "device mix":  # the CPU run has one device: neuron must raise the device-mismatch RuntimeError
        cpu_exc = RuntimeError("Expected all tensors to be on the same device")
    same = type(got) is type(cpu_exc)
    queued_busy = not torch.neuron.current_stream().query()
    check(same, f"{name}: at the call neuron raised {type(got).__name__} (CPU {type(cpu_exc).__name__}){'' if same else ' | neuron: ' + str(got)[:120] + ' | cpu: ' + str(cpu_exc)[:120]}")
    try:
        drain_err = None
        torch.neuron.synchronize()
    except Exception as ex:  # noqa: BLE001
        drain_err = ex
    check(drain_err is None, f"{name}: nothing deferred to the next sync" + ("" if drain_err is None else f" (got {type(drain_err).__name__}: {str(drain_err)[:150]})"))
    check(torch.equal(y.cpu(), torch.full((1024, 1024), 3.0)), f"{name}: queued work unaffected")
    drain()
done()
