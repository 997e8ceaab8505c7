"""``TorchState``'s commit and rollback, in one process: what was written since a commit is
rolled back exactly, whatever way it was written (in place, by an optimizer step, by
replacing a parameter's data, by changing the optimizer's layout or hyperparameters), and
no write to a live tensor reaches the copy a rollback returns to, also after a rollback that
handed copy-on-write clones of it over. The native copy
that commits and rollbacks use gives every byte of every region, on one thread or split
across several (a region larger than a thread's share is split between threads).
"""

import torch

import hvd.torch as hvd
from hvd import _hvd


def snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for i, s in opt.state_dict()["state"].items()},
            [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups])


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def step(model, opt):
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()


def main():
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    frozen = torch.nn.Linear(16, 16)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, frozen=frozen, epoch=0)
    step(model, opt)
    state.commit()
    committed = snapshot(model, opt)
    frozen_before = {k: v.clone() for k, v in frozen.state_dict().items()}

    # Writes of every kind after the commit.
    step(model, opt)
    step(model, opt)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    model[2].bias.data = torch.full_like(model[2].bias, 7.0)
    opt.param_groups[0]["lr"] = 0.5
    state.epoch = 3
    assert not same(snapshot(model, opt), committed), "the writes changed nothing"

    state.restore()
    assert same(snapshot(model, opt), committed), "the rollback missed a write"
    assert state.epoch == 0
    assert same(frozen.state_dict(), frozen_before)
    # hvd's in-place collectives write tensor memory natively: they move the version too,
    # as an in-place operator does, so autograd sees the write.
    t = torch.zeros(4)
    for write in (lambda t: hvd.allreduce_(t, op=hvd.Sum), lambda t: hvd.broadcast_(t, 0),
                  lambda t: hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum))):
        before_write = t._version
        write(t)
        assert t._version > before_write, "a native write kept the version"

    # The rolled-back model trains on as the committed one would.
    twin = snapshot(model, opt)
    torch.manual_seed(1)
    step(model, opt)
    after = snapshot(model, opt)
    state.restore()
    assert same(snapshot(model, opt), twin)
    torch.manual_seed(1)
    step(model, opt)
    assert same(snapshot(model, opt), after), "a rollback left the optimizer elsewhere"

    # A rollback copies what an in-place operator wrote since the commit back into its own
    # memory; a tensor nothing wrote in place since one commit shares the copy's memory as a
    # copy-on-write clone from the next, which commits and rollbacks skip. Writes of every
    # kind to a clone (numpy, .data, an in-place operator, an optimizer step) never reach the
    # copy: every rollback returns to the commit.
    cow = torch._C._is_cow_tensor
    state.commit()
    committed = snapshot(model, opt)
    step(model, opt)
    state.restore()
    assert same(snapshot(model, opt), committed)
    assert not cow(model[0].weight), "a trained weight was handed a clone, not copied back"
    state.commit()
    state.commit()
    assert cow(frozen.weight) and cow(frozen.bias), "an unchanged tensor is copied at every commit"
    frozen_committed = {k: v.clone() for k, v in frozen.state_dict().items()}
    committed = snapshot(model, opt)
    frozen.weight.detach().numpy()[0, 0] = 123.0
    frozen.bias.data[0] = 55.0
    state.restore()
    assert same(frozen.state_dict(), frozen_committed), "a write to a clone reached the copy"
    assert same(snapshot(model, opt), committed)
    # Rolled back without an in-place write since the commit, the model and optimizer get
    # clones too; a second rollback after writes of every kind returns to the commit.
    state.restore()
    assert cow(model[0].weight) and cow(opt.state[model[0].weight]["exp_avg"])
    model[0].weight.detach().numpy()[0, 0] = 123.0
    model[0].bias.data[0] = 55.0
    with torch.no_grad():
        model[2].weight.mul_(2.0)
    opt.state[model[0].weight]["exp_avg"].numpy()[0, 0] = 9.0
    step(model, opt)
    state.restore()
    assert same(snapshot(model, opt), committed), "a write after a rollback reached the commit"
    state.commit()
    assert same(snapshot(model, opt), committed)
    with torch.no_grad():
        frozen.weight.add_(1.0)
    step(model, opt)
    state.restore()
    assert same(snapshot(model, opt), committed), "a commit after a rollback lost the commit"
    assert same(frozen.state_dict(), frozen_committed)
    # A buffer that is a view of other memory is written back in place: it stays a view.
    holder = torch.nn.Module()
    base = torch.zeros(4)
    holder.register_buffer("part", base[1:3])
    viewed = hvd.elastic.TorchState(model=holder)
    with torch.no_grad():
        holder.part.add_(5.0)
    viewed.restore()
    assert holder.part._base is base and torch.equal(base, torch.zeros(4)), base

    # State the commit did not have (Adam's moments, created by the first step after it)
    # is dropped by the rollback, as a load of the committed state_dict drops it.
    fresh_model = torch.nn.Linear(4, 1)
    fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
    fresh = hvd.elastic.TorchState(model=fresh_model, optimizer=fresh_opt)
    before = snapshot(fresh_model, fresh_opt)
    opt_step = lambda: (fresh_opt.zero_grad(), fresh_model(torch.ones(2, 4)).sum().backward(),
                        fresh_opt.step())
    opt_step()
    assert fresh_opt.state_dict()["state"], "the step made no optimizer state"
    fresh.restore()
    assert same(snapshot(fresh_model, fresh_opt), before)
    assert not fresh_opt.state_dict()["state"]
    # A rollback across a layout change (state for a parameter the commit had none for)
    # loads the commit whole, and the optimizer it loads into shares no memory with the
    # commit: a later step and a second rollback still return to the commit.
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    two_opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    two = hvd.elastic.TorchState(optimizer=two_opt, a=a, b=b)

    def two_step(params):
        two_opt.zero_grad()
        sum(p.sum() for p in params).backward()
        two_opt.step()

    two_step([a])
    two.commit()
    committed = {i: s["momentum_buffer"].clone()
                 for i, s in two_opt.state_dict()["state"].items()}
    two_step([a, b])
    two.restore()
    assert {i: s["momentum_buffer"] for i, s in two_opt.state_dict()["state"].items()}.keys() \
        == committed.keys()
    two_step([a])
    two.restore()
    for i, s in two_opt.state_dict()["state"].items():
        assert torch.equal(s["momentum_buffer"], committed[i]), "the commit was written to"
    check_native_copies()
    print(f"torch state ok: rank {hvd.rank()} of {hvd.size()}")


def check_native_copies():
    # 12 MiB in all (over the single-thread cutoff) in regions of odd sizes, one of them
    # larger than a share at any thread count.
    g = torch.Generator().manual_seed(3)
    sizes = [1, 7, 4099, 2_500_000, 13, 511_111, 0, 123_457]
    for threads in (None, 1, 2, 3, 8):
        srcs = [torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8) for n in sizes]
        srcs[3] = torch.randn(2_500_000, generator=g)
        dsts = [torch.zeros_like(t) for t in srcs]
        regions = [(d.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
                   for d, t in zip(dsts, srcs)]
        if threads is None:
            _hvd.copy_regions(regions)
        else:
            _hvd.copy_regions(regions, threads)
        for i, (d, t) in enumerate(zip(dsts, srcs)):
            assert torch.equal(d, t), f"region {i} ({t.numel()} elements) differs at " \
                                      f"{threads} threads"


if __name__ == "__main__":
    main()
