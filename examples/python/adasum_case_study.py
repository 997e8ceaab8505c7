"""The Adasum chapter's small case study: fit the coefficients of a polynomial of degree 2 by
SGD, every rank on its own random batches (features uniform in [0, x_max), labels exact),
once with ``DistributedOptimizer(op=hvd.Average)`` and once with ``op=hvd.Adasum``, both at
the learning rate that suits one worker (not scaled with the ranks). Counts the steps each
takes until every coefficient is within ``--tol`` of the truth:

    horovodrun -np 4 -H 127.0.0.1:4 python examples/python/adasum_case_study.py

Averaging more ranks' gradients only lowers the noise of a step of the same size, so it
needs about as many steps as one worker; Adasum adds what the ranks' gradients do not share,
so its steps are longer where they disagree and it needs fewer. Rank 0 prints one line per
op and a JSON summary.
"""

import argparse
import json

import torch

import hvd.torch as hvd

TRUE = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)


def features(x):
    return torch.stack([torch.ones_like(x), x, x * x], dim=1)


def train(op, name, args):
    """Steps until every coefficient is within ``args.tol`` of the truth (at most
    ``args.max_steps``); the parameters are the same on every rank after each step, so every
    rank stops at the same one."""
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=args.lr),
                                   named_parameters=[(f"{name}.w", w)], op=op)
    gen = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    for step in range(1, args.max_steps + 1):
        x = torch.rand(args.batch, generator=gen, dtype=torch.float64) * args.x_max
        f = features(x)
        loss = torch.nn.functional.mse_loss(f @ w, f @ TRUE)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if float((w.detach() - TRUE).abs().max()) < args.tol:
            return step
    return args.max_steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.3, help="one worker's learning rate")
    p.add_argument("--x-max", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tol", type=float, default=0.01)
    p.add_argument("--max-steps", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    hvd.init()
    steps = {"average": train(hvd.Average, "average", args),
             "adasum": train(hvd.Adasum, "adasum", args)}
    if hvd.rank() == 0:
        for op, k in steps.items():
            print(f"{op}: {k} steps on {hvd.size()} ranks to every coefficient within "
                  f"{args.tol} (lr {args.lr}, not scaled)", flush=True)
        print(json.dumps({"ranks": hvd.size(), "lr": args.lr, "x_max": args.x_max,
                          "average_steps": steps["average"],
                          "adasum_steps": steps["adasum"]}), flush=True)


if __name__ == "__main__":
    main()
