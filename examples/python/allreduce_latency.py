"""Latency of a small ``hvd.allreduce_`` called from Python, next to the Rust
``allreduce_bench`` figure for the same bytes:

    horovodrun -np 2 -H 127.0.0.1:2 python examples/python/allreduce_latency.py
    horovodrun -np 2 -H 127.0.0.1:2 target/release/examples/allreduce_bench \\
        --min-bytes 4 --max-bytes 4 --iters 2000

Times ``--iters`` in-place allreduces of one float32 (4 bytes, by default) after
``--warmup`` of them, each rank checking the result, and prints rank 0's mean and median
microseconds per call.
"""

import argparse
import statistics
import time
import warnings

import torch

import hvd.torch as hvd

warnings.filterwarnings("ignore", message=".*NumPy.*")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elements", type=int, default=1)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    args = p.parse_args()
    hvd.init()
    n = hvd.size()
    t = torch.ones(args.elements)
    for _ in range(args.warmup):
        hvd.allreduce_(t.fill_(1.0), op=hvd.Sum)
    times = []
    for _ in range(args.iters):
        t.fill_(1.0)
        start = time.perf_counter()
        hvd.allreduce_(t, op=hvd.Sum)
        times.append(time.perf_counter() - start)
        if t[0].item() != n:
            raise SystemExit(f"allreduce gave {t[0].item()} in a world of {n}")
    if hvd.rank() == 0:
        us = [x * 1e6 for x in times]
        print(f"hvd.allreduce_ of {4 * args.elements} B from Python on {n} ranks: mean "
              f"{statistics.mean(us):.2f} us, median {statistics.median(us):.2f} us "
              f"over {args.iters} calls", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
