"""Gradient synchronisation of a ResNet-50-sized gradient set (its 161 tensors, 25.6 M
float32), as a training step produces it, timed three ways in one script:

- ``hvd``: every gradient submitted as it is ready (``allreduce_async_``, last layer first, as
  backward hooks submit them), then all waited for; the engine fuses what is ready;
- ``gloo``: PyTorch DDP's scheme over Gloo, the gradients packed into 25 MiB buckets (last
  layer first) and each bucket allreduced, then unpacked (run it under ``torchrun --gloo``).

``--op adasum`` times hvd's Adasum of the same gradients instead of their average.

    horovodrun -np 2 -H 127.0.0.1:2 python examples/python/grad_sync_bench.py
    python -m torch.distributed.run --nproc_per_node 2 examples/python/grad_sync_bench.py --gloo
    horovodrun -np 2 -H 127.0.0.1:2 target/release/examples/fusion_bench \\
        --tensors 161 --elems 25557032

Prints rank 0's median milliseconds per synchronisation over ``--iters`` after a warm-up,
and a JSON line; every rank checks the averaged result.
"""

import argparse
import json
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore", message=".*NumPy.*")

BUCKET_BYTES = 25 << 20


def shapes(model):
    if model == "resnet50":
        import torchvision

        return [tuple(p.shape) for p in torchvision.models.resnet50().parameters()]
    # Small sets for tests: a few tensors of a few sizes.
    return [(64, 3, 7, 7), (64,), (256, 64, 1, 1), (1000, 2048), (1000,)]


def adasum_of_constants(size):
    """What Adasum makes of ranks whose gradients are all ``rank + 1`` everywhere: parallel
    gradients ``a`` and ``b`` combine to ``(a + b) / 2``, up the ranks' tree (the first
    ceil(n/2) ranks' result with the rest's)."""
    def tree(values):
        if len(values) == 1:
            return values[0]
        mid = (len(values) + 1) // 2
        return (tree(values[:mid]) + tree(values[mid:])) / 2
    return tree([float(r + 1) for r in range(size)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gloo", action="store_true", help="DDP's buckets over Gloo (torchrun)")
    p.add_argument("--model", default="resnet50", help="resnet50, or small (tests)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--op", choices=["average", "adasum"], default="average",
                   help="hvd's reduction (the Gloo baseline always averages)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.gloo:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        import hvd.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    grads = [torch.full(s, float(rank + 1)) for s in shapes(args.model)]
    elems = sum(g.numel() for g in grads)
    order = list(reversed(range(len(grads))))  # backward produces the last layer first

    def sync_hvd():
        op = hvd.Adasum if args.op == "adasum" else hvd.Average
        handles = [hvd.allreduce_async_(grads[i], name=f"grad.{i}", op=op) for i in order]
        for h in handles:
            hvd.synchronize(h)

    buckets, current, used = [], [], 0
    for i in order:
        nbytes = grads[i].numel() * 4
        if current and used + nbytes > BUCKET_BYTES:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += nbytes
    if current:
        buckets.append(current)

    def sync_gloo():
        for b in buckets:
            flat = torch.cat([grads[i].view(-1) for i in b])
            dist.all_reduce(flat)
            flat.div_(size)
            at = 0
            for i in b:
                n = grads[i].numel()
                grads[i].copy_(flat[at:at + n].view_as(grads[i]))
                at += n

    sync = sync_gloo if args.gloo else sync_hvd
    times = []
    for k in range(args.warmup + args.iters):
        for g in grads:
            g.fill_(float(rank + 1))
        if args.gloo:
            dist.barrier()
        else:
            hvd.barrier()
        t = time.perf_counter()
        sync()
        if k >= args.warmup:
            times.append(time.perf_counter() - t)
        want = adasum_of_constants(size) if args.op == "adasum" and not args.gloo else (size + 1) / 2
        if not all(torch.allclose(g, torch.full_like(g, want), rtol=1e-5) for g in grads):
            raise SystemExit(f"rank {rank}: the reduced gradients are wrong")
    if rank == 0:
        ms = statistics.median(times) * 1000
        system = "DDP buckets over Gloo" if args.gloo else "hvd"
        op = "average" if args.gloo else args.op
        print(f"{system} ({op}): {len(grads)} tensors, {elems} float32, {size} ranks: median "
              f"{ms:.1f} ms per synchronisation over {args.iters}", flush=True)
        print(json.dumps({"system": system, "op": op, "tensors": len(grads), "elems": elems,
                          "ranks": size, "median_ms": ms}), flush=True)


if __name__ == "__main__":
    main()
