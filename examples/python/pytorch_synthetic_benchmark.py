"""Synthetic training throughput of a torchvision model, under hvd or under PyTorch DDP over
Gloo, so the two are compared on the same machine with the same script.

    horovodrun -np 2 -H 127.0.0.1:2 python pytorch_synthetic_benchmark.py --model resnet18
    python -m torch.distributed.run --nproc_per_node 2 pytorch_synthetic_benchmark.py \\
        --ddp --model resnet18

Every rank trains on random images and labels (no data loading), with SGD; after warm-up
batches, ``--num-iters`` timed iterations of ``--num-batches-per-iter`` batches each. It
prints img/sec per rank (mean ± 1.96 standard deviations over the iterations), the total
(ranks × mean), and a last line of JSON for scripts. ``--threads`` sets
``torch.set_num_threads`` per rank (1 by default: ranks share this machine's cores).
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message=".*NumPy.*")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", help="a torchvision.models name")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per batch")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--fp16-allreduce", action="store_true", help="hvd: fp16 on the wire")
    p.add_argument("--ddp", action="store_true",
                   help="PyTorch DistributedDataParallel over Gloo (run under torchrun)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    return p.parse_args()


def main():
    args = parse()
    torch.set_num_threads(args.threads)
    import torchvision

    if args.ddp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        import hvd.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters(),
                                             compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))

    def batch():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    system = "DDP over Gloo" if args.ddp else "hvd"
    log(f"{system}: model {args.model}, batch {args.batch_size} of {args.image_size}px per "
        f"rank, {size} ranks, {args.threads} thread(s) each")
    for _ in range(args.num_warmup_batches):
        batch()
    rates = []
    for i in range(args.num_iters):
        t = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            batch()
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - t)
        log(f"iter #{i}: {rate:.1f} img/sec per rank")
        rates.append(rate)
    mean = statistics.mean(rates)
    conf = 1.96 * (statistics.stdev(rates) if len(rates) > 1 else 0.0)
    log(f"img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"total img/sec on {size} rank(s): {size * mean:.1f} +-{size * conf:.1f}")
    log(json.dumps({"system": system, "model": args.model, "ranks": size,
                    "img_sec_per_rank": mean, "img_sec_total": size * mean,
                    "conf": conf}))
    if args.ddp:
        torch.distributed.destroy_process_group()
    else:
        hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
