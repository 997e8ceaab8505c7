"""``op=hvd.Adasum`` on every rank against a plain NumPy reference of the same recursion.

Run under ``horovodrun`` on any number of ranks. Each rank builds every rank's inputs from
their seeds, so it can compute the reference itself: the allreduce of one tensor, of fused
groups (tensors of unequal sizes on both sides of the 32 KiB small-call threshold, one of
them empty), asynchronous and synchronous, for float16, bfloat16, float32 and float64; and
``DistributedOptimizer(op=hvd.Adasum)`` (SGD with momentum, with and without gradient
accumulation) against the delta form computed here from every rank's local optimizer.
Prints ``adasum ok: rank R of N`` when every check passed.
"""

import copy

import numpy as np
import torch

import hvd.torch as hvd


def pair(a, b):
    """Adasum of two gradients in float64, as the paper and Horovod define it."""
    fa, fb = a.ravel(), b.ravel()
    dot, na, nb = float(fa @ fb), float(fa @ fa), float(fb @ fb)
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    ca = 1.0 - dot / (2.0 * na) if na >= tiny else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb >= tiny else 1.0
    return ca * a + cb * b


def tree(vs):
    """The ranks' recursion: the first ceil(n/2) ranks' result combined with the rest's."""
    if len(vs) == 1:
        return vs[0]
    mid = (len(vs) + 1) // 2
    return pair(tree(vs[:mid]), tree(vs[mid:]))


SIZES = [5, 0, 12_000, 300]
TOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 1e-5, torch.float64: 1e-12}


def inputs(rank, dtype):
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(k, generator=g, dtype=torch.float64) + 0.3 * (rank + 1)).to(dtype)
            for k in SIZES]


def reference(n, dtype):
    per_rank = [inputs(q, dtype) for q in range(n)]
    return [tree([per_rank[q][t].double().numpy() for q in range(n)])
            for t in range(len(SIZES))]


def close(got, want, dtype, what):
    got = got.double().numpy()
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    err = float(np.abs(got - want).max(initial=0.0))
    assert err <= TOL[dtype] * scale, f"{what}: off by {err} (scale {scale})"


def check_allreduce(r, n):
    for dtype in TOL:
        want = reference(n, dtype)
        mine = inputs(r, dtype)
        # One tensor at a time, synchronous.
        for t, x in enumerate(mine):
            close(hvd.allreduce(x, op=hvd.Adasum), want[t], dtype, f"{dtype} tensor {t}")
        # A fused group through the engine: each tensor still combines on its own.
        got = hvd.grouped_allreduce([x.clone() for x in mine], op=hvd.Adasum,
                                    name=f"group.{dtype}")
        for t, x in enumerate(got):
            close(x, want[t], dtype, f"{dtype} grouped tensor {t}")
        handles = [hvd.allreduce_async(x, op=hvd.Adasum, name=f"async.{dtype}.{t}")
                   for t, x in enumerate(mine)]
        for t, h in enumerate(handles):
            close(hvd.synchronize(h), want[t], dtype, f"{dtype} async tensor {t}")
    # Identical gradients come back unchanged; orthogonal ones add.
    same = torch.tensor([1.5, -2.0, 4.0])
    assert torch.equal(hvd.allreduce(same, op=hvd.Adasum), same)
    basis = torch.zeros(n, dtype=torch.float64)
    basis[r] = r + 1.0
    got = hvd.allreduce(basis, op=hvd.Adasum)
    assert torch.equal(got, torch.arange(1, n + 1, dtype=torch.float64)), got


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(rank, step, k):
    g = torch.Generator().manual_seed(rank * 7919 + step * 31 + k)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def check_optimizer(r, n, passes):
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   op=hvd.Adasum, backward_passes_per_step=passes)
    # The reference: every rank's model and local optimizer, stepped here.
    torch.manual_seed(0)
    ref = Net()
    locals_ = [copy.deepcopy(ref) for _ in range(n)]
    local_opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in locals_]
    for step in range(3):
        opt.zero_grad()
        for k in range(passes):
            loss_of(model, *batch(r, step, k)).backward()
        opt.step()
        deltas = []
        for q in range(n):
            m, o = locals_[q], local_opts[q]
            m.load_state_dict(ref.state_dict())
            o.zero_grad()
            for k in range(passes):
                loss_of(m, *batch(q, step, k)).backward()
            o.step()
            deltas.append({k: (v - ref.state_dict()[k]).double().numpy()
                           for k, v in m.state_dict().items()})
        new = {k: ref.state_dict()[k].double().numpy() + tree([d[k] for d in deltas])
               for k in ref.state_dict()}
        ref.load_state_dict({k: torch.from_numpy(v).float() for k, v in new.items()})
        for k, v in model.state_dict().items():
            close(v, ref.state_dict()[k].double().numpy(), torch.float32,
                  f"optimizer ({passes} passes) step {step} {k}")


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    check_allreduce(r, n)
    check_optimizer(r, n, passes=1)
    check_optimizer(r, n, passes=2)
    print(f"adasum ok: rank {r} of {n}", flush=True)


if __name__ == "__main__":
    main()
