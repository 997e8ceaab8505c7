"""``hvd.DistributedOptimizer`` under ``horovodrun -np N``: every rank ends with the same
parameters, equal (to float tolerance) to one process training on the union of the ranks'
batches; with gradient accumulation (``backward_passes_per_step``), fp16 compression, a
parameter that gets no gradient, and Horovod's errors and warnings.

Prints ``optimizer ok: rank R of N`` and exits 0, or raises.
"""

import warnings

import torch

import hvd.torch as hvd

STEPS = 6
BATCH = 5


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(3, 3)  # never in the forward pass: no gradient

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batches(step, n, passes):
    """The union batch of ``step`` (``passes`` micro-batches of every rank's rows)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(passes, n * BATCH, 8, generator=g)
    y = torch.randn(passes, n * BATCH, 4, generator=g)
    return x, y


def train(distributed, passes=1, compression=hvd.Compression.none, op=hvd.Average,
          gpf=1.0, groups=None):
    """Trains a fresh Net for STEPS steps; returns its parameters. ``distributed``: each rank
    takes its rows of every micro-batch through a DistributedOptimizer; otherwise one
    process takes them all."""
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression, backward_passes_per_step=passes,
                                       op=op, gradient_predivide_factor=gpf,
                                       groups=groups(model) if callable(groups) else groups)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(STEPS):
        x, y = batches(step, n, passes)
        opt.zero_grad()
        for k in range(passes):
            if distributed:
                xs, ys = x[k, r * BATCH:(r + 1) * BATCH], y[k, r * BATCH:(r + 1) * BATCH]
            else:
                xs, ys = x[k], y[k]
            loss = torch.nn.functional.mse_loss(model(xs), ys)
            loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def same_everywhere(params):
    """Every rank holds exactly rank 0's parameters."""
    for p in params:
        assert torch.equal(hvd.broadcast(p, root_rank=0), p), "ranks disagree"


def close_to(params, reference, tol):
    for p, q in zip(params, reference):
        assert torch.allclose(p, q, rtol=tol, atol=tol), (p - q).abs().max()


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for passes in (1, 2):
        reference, _ = train(False, passes)
        params, opt = train(True, passes)
        same_everywhere(params)
        close_to(params, reference, 1e-5)
        # The parameter no rank used got a zero gradient, reduced, and stayed where it was.
        torch.manual_seed(0)
        fresh = Net()
        assert torch.equal(params[-1], fresh.unused.bias.detach())
    # Explicit groups (a count, or lists with the rest each its own) reduce the same
    # gradients; the unused parameter's group gets its zeros.
    for groups in (2, 3, lambda m: [[m.a.weight, m.unused.bias], [m.a.bias]]):
        params, _ = train(True, 2, groups=groups)
        same_everywhere(params)
        close_to(params, train(False, 2)[0], 1e-5)
    params, _ = train(True, 1, gpf=2.0)
    close_to(params, train(False, 1)[0], 1e-5)
    params, _ = train(True, 1, compression=hvd.Compression.fp16)
    same_everywhere(params)
    close_to(params, train(False, 1)[0], 2e-2)
    # Sum: the gradient of the union's loss times the number of ranks, so a run with the
    # learning rate divided by n matches the average's... checked on one step's gradients.
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    x, y = batches(0, n, 1)
    torch.nn.functional.mse_loss(model(x[0, r * BATCH:(r + 1) * BATCH]),
                                 y[0, r * BATCH:(r + 1) * BATCH]).backward()
    opt.synchronize()
    summed = model.a.weight.grad.clone()
    torch.manual_seed(0)
    one = Net()
    torch.nn.functional.mse_loss(one(x[0]), y[0]).backward()
    assert torch.allclose(summed, one.a.weight.grad * n, rtol=1e-5, atol=1e-6)
    with opt.skip_synchronize():
        opt.step()

    if n > 1:
        # zero_grad() while allreduces are pending is Horovod's error.
        torch.manual_seed(0)
        model = Net()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        torch.nn.functional.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 4)).backward()
        try:
            opt.zero_grad()
        except AssertionError as e:
            assert "before optimizer.step() or optimizer.synchronize()" in str(e), str(e)
        else:
            raise AssertionError("zero_grad() with allreduces pending went through")
        opt.synchronize()
        # A step after synchronize() outside skip_synchronize() warns.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert any("skip_synchronize" in str(w.message) for w in caught), caught
        # A second backward pass before step() with backward_passes_per_step=1.
        loss = torch.nn.functional.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 4))
        loss.backward(retain_graph=True)
        try:
            loss.backward()
        except AssertionError as e:
            assert "backward_passes_per_step" in str(e), str(e)
        else:
            raise AssertionError("a second backward pass before step() went through")
        opt.synchronize()

    for bad, what in [
        (lambda: hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=1),
                                          op=hvd.Adasum, groups=2), "not supported with"),
        (lambda: hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=1),
                                          named_parameters=[("x", torch.nn.Parameter(
                                              torch.ones(1)))]), "does not name"),
        (lambda: hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=1),
                                          backward_passes_per_step=0), "at least 1"),
        (lambda: hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=1),
                                          groups=-1), "non-negative"),
        (lambda: hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=1),
                                          groups=[[torch.nn.Parameter(torch.ones(1))]]),
         "does not train"),
    ]:
        try:
            bad()
        except (ValueError, NotImplementedError) as e:
            assert what in str(e), (what, str(e))
        else:
            raise AssertionError(f"no error for {what}")

    # broadcast_object and broadcast_optimizer_state.
    got = hvd.broadcast_object({"rank": r, "list": list(range(r + 3))}, root_rank=n - 1)
    assert got == {"rank": n - 1, "list": list(range(n + 2))}, got
    torch.manual_seed(r)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    torch.nn.functional.mse_loss(model(torch.randn(3, 8)), torch.randn(3, 4)).backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.1, opt.param_groups[0]["lr"]
    buf = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(hvd.broadcast(buf, root_rank=0), buf)

    print(f"optimizer ok: rank {r} of {n}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
