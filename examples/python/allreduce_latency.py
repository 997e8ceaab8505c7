"""Latency of a small hvd allreduce called from Python, next to the Rust
``allreduce_bench`` figure for the same bytes:

    horovodrun -np 2 -H 127.0.0.1:2 python examples/python/allreduce_latency.py
    horovodrun -np 2 -H 127.0.0.1:2 python examples/python/allreduce_latency.py \\
        --framework tensorflow
    horovodrun -np 2 -H 127.0.0.1:2 target/release/examples/allreduce_bench \\
        --min-bytes 4 --max-bytes 4 --iters 2000

Times ``--iters`` allreduces of one float32 (4 bytes, by default) after ``--warmup`` of
them, each rank checking the result, and prints rank 0's mean and median microseconds per
call: PyTorch's in-place ``hvd.allreduce_``, or with ``--framework tensorflow``
``hvd.tensorflow.allreduce`` of an eager tensor, the same inside a ``tf.function``, and a
``tf.function`` of ``tf.identity`` alone (TensorFlow's own cost of the call).
"""

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message=".*NumPy.*")


def timed(prepare, call, check, iters, warmup):
    """Seconds per ``call()`` over ``iters`` calls after ``warmup``; ``prepare()`` runs
    before each call and ``check(result)`` after it, neither timed."""
    for _ in range(warmup):
        prepare()
        check(call())
    times = []
    for _ in range(iters):
        prepare()
        start = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - start)
        check(out)
    return times


def report(what, elements, n, times):
    us = [x * 1e6 for x in times]
    print(f"{what} of {4 * elements} B from Python on {n} ranks: mean "
          f"{statistics.mean(us):.2f} us, median {statistics.median(us):.2f} us "
          f"over {len(us)} calls", flush=True)


def torch_latency(args):
    import torch

    import hvd.torch as hvd

    hvd.init()
    n = hvd.size()
    t = torch.ones(args.elements)

    def check(out):
        if out[0].item() != n:
            raise SystemExit(f"allreduce gave {out[0].item()} in a world of {n}")

    times = timed(lambda: t.fill_(1.0), lambda: hvd.allreduce_(t, op=hvd.Sum), check,
                  args.iters, args.warmup)
    if hvd.rank() == 0:
        report("hvd.allreduce_", args.elements, n, times)
    hvd.shutdown()


def tensorflow_latency(args):
    import tensorflow as tf

    import hvd.tensorflow as hvd

    hvd.init()
    n = hvd.size()
    x = tf.ones([args.elements])

    def check(out):
        if out.numpy()[0] != n:
            raise SystemExit(f"allreduce gave {out.numpy()[0]} in a world of {n}")

    in_graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))
    # TensorFlow's own cost of calling a tf.function, to set beside the allreduce in one.
    identity = tf.function(tf.identity)
    results = [
        ("hvd.tensorflow.allreduce (eager)",
         timed(lambda: None, lambda: hvd.allreduce(x, op=hvd.Sum), check, args.iters,
               args.warmup)),
        ("hvd.tensorflow.allreduce (tf.function)",
         timed(lambda: None, lambda: in_graph(x), check, args.iters, args.warmup)),
        ("tf.function(tf.identity) without hvd",
         timed(lambda: None, lambda: identity(x), lambda out: None, args.iters, args.warmup)),
    ]
    if hvd.rank() == 0:
        for what, times in results:
            report(what, args.elements, n, times)
    hvd.shutdown()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elements", type=int, default=1)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--framework", choices=["torch", "tensorflow"], default="torch")
    args = p.parse_args()
    if args.framework == "torch":
        torch_latency(args)
    else:
        tensorflow_latency(args)


if __name__ == "__main__":
    main()
