"""``hvd.join()`` while the other ranks still train, as Horovod's. ``--mode sync``: rank
``p`` runs ``p + 1`` steps of synchronous ops only (no rank has started its engine), then
joins; then every rank joins at the same call (and all name the same last rank). ``--mode async``: rank ``p`` runs ``p`` steps
of asynchronous allreduces, so rank 0 joins without ever having started its engine while
the others' engines run. A joined rank counts as zeros in the others' allreduces (averages
divide by the whole world, as in Horovod), and every rank learns the rank that joined last.
Prints ``join ok: rank R of N`` when every check passed.
"""

import argparse

import torch

import hvd.torch as hvd


def live(n, step):
    return sum(1 for p in range(n) if p + 1 > step)


def asynchronous(r, n):
    for step in range(r):
        h = hvd.allreduce_async(torch.ones(4), op=hvd.Sum, name=f"step.{step}")
        want = sum(1 for p in range(n) if p > step)
        got = hvd.synchronize(h)
        assert torch.equal(got, torch.full((4,), float(want))), (step, got)
    assert hvd.join() == n - 1
    got = hvd.synchronize(hvd.allreduce_async(torch.ones(1), op=hvd.Sum))
    assert torch.equal(got, torch.full((1,), float(n))), got


def main():
    mode = argparse.ArgumentParser()
    mode.add_argument("--mode", choices=["sync", "async"], default="sync")
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if mode.parse_args().mode == "async":
        asynchronous(r, n)
        print(f"join ok: rank {r} of {n}", flush=True)
        return

    # Synchronous ops only: no rank has started its engine.
    for step in range(r + 1):
        got = hvd.allreduce(torch.ones(3, dtype=torch.float64), op=hvd.Sum)
        assert torch.equal(got, torch.full((3,), float(live(n, step)),
                                           dtype=torch.float64)), (step, got)
        big = hvd.allreduce(torch.full((50_000,), 2.0))
        assert torch.equal(big, torch.full((50_000,), 2.0 * live(n, step) / n)), step
    assert hvd.join() == n - 1, "the last to join is the highest rank"
    got = hvd.allreduce(torch.ones(1), op=hvd.Sum)
    assert torch.equal(got, torch.full((1,), float(n))), got

    # Every rank joins at the same call. Which join the engines saw last depends on timing
    # (several in one cycle count the highest rank): every rank names the same one.
    last = hvd.join()
    named = hvd.allgather(torch.tensor([last]))
    assert 0 <= last < n and torch.equal(named, torch.full((n,), last)), (last, named)
    print(f"join ok: rank {r} of {n}", flush=True)


if __name__ == "__main__":
    main()
