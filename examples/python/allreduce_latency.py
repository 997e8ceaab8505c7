"""Latency of a small hvd allreduce called from Python, next to the Rust
``allreduce_bench`` figure for the same bytes:

    horovodrun -np 2 -H 127.0.0.1:2 python examples/python/allreduce_latency.py
    horovodrun -np 2 -H 127.0.0.1:2 python examples/python/allreduce_latency.py \\
        --framework tensorflow
    horovodrun -np 2 -H 127.0.0.1:2 python examples/python/allreduce_latency.py \\
        --framework jax
    horovodrun -np 2 -H 127.0.0.1:2 target/release/examples/allreduce_bench \\
        --min-bytes 4 --max-bytes 4 --iters 2000

Times ``--iters`` allreduces of one float32 (4 bytes, by default) after ``--warmup`` of
them, each rank checking the result, and prints rank 0's mean and median microseconds per
call: PyTorch's in-place ``hvd.allreduce_``, or with ``--framework tensorflow``
``hvd.tensorflow.allreduce`` of an eager tensor, the same inside a ``tf.function``, a
``tf.function`` of ``tf.identity`` alone (TensorFlow's own cost of the call), and what one
allreduce adds inside a ``tf.function`` of ``--chain`` of them, beyond that call (the
difference of sorted samples, divided by the chain); with ``--framework jax`` the same for
``hvd.jax.allreduce`` of a ``jax.Array``, eager and inside ``jax.jit`` (an ordered host
callback), beside a jitted identity.
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

    def check_sum(want):
        def check(out):
            if out.numpy()[0] != want:
                raise SystemExit(f"allreduce gave {out.numpy()[0]}, not {want}, in a world "
                                 f"of {n}")
        return check

    in_graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))

    @tf.function
    def chained(t):
        for _ in range(args.chain):
            # Averages of ones stay ones, however long the chain and large the world.
            t = hvd.allreduce(t, op=hvd.Average)
        return t

    # TensorFlow's own cost of calling a tf.function, to set beside the allreduce in one.
    identity = tf.function(tf.identity)
    eager = timed(lambda: None, lambda: hvd.allreduce(x, op=hvd.Sum), check_sum(n),
                  args.iters, args.warmup)
    one = timed(lambda: None, lambda: in_graph(x), check_sum(n), args.iters, args.warmup)
    call = timed(lambda: None, lambda: identity(x), check_sum(1), args.iters, args.warmup)
    many = timed(lambda: None, lambda: chained(x), check_sum(1), args.iters,
                 args.warmup)
    if hvd.rank() == 0:
        report("hvd.tensorflow.allreduce (eager)", args.elements, n, eager)
        report("hvd.tensorflow.allreduce (tf.function)", args.elements, n, one)
        report("tf.function(tf.identity) without hvd", args.elements, n, call)
        # The cost of an allreduce inside a graph, beyond TensorFlow's cost of the call.
        beyond = [(m - c) / args.chain for m, c in zip(sorted(many), sorted(call))]
        report(f"hvd.tensorflow.allreduce in a tf.function of {args.chain}, each, beyond "
               f"the call", args.elements, n, beyond)
    hvd.shutdown()


def jax_latency(args):
    import jax
    import jax.numpy as jnp
    import numpy as _np

    import hvd.jax as hvd

    hvd.init()
    n = hvd.size()
    x = jnp.ones([args.elements], dtype=jnp.float32)

    def check_sum(want):
        def check(out):
            # Read on the host: indexing the array would run an XLA computation, whose
            # thread pool then spins for a while, taking a core from the next call's peer.
            got = float(_np.asarray(out)[0])
            if got != want:
                raise SystemExit(f"allreduce gave {got}, not {want}, in a world of {n}")
        return check

    def ready(out):
        return out.block_until_ready()

    in_jit = jax.jit(lambda t: hvd.allreduce(t, op=hvd.Sum))

    @jax.jit
    def chained(t):
        for _ in range(args.chain):
            t = hvd.allreduce(t, op=hvd.Average)
        return t

    identity = jax.jit(lambda t: t + 0)
    eager = timed(lambda: None, lambda: ready(hvd.allreduce(x, op=hvd.Sum)), check_sum(n),
                  args.iters, args.warmup)
    one = timed(lambda: None, lambda: ready(in_jit(x)), check_sum(n), args.iters,
                args.warmup)
    call = timed(lambda: None, lambda: ready(identity(x)), check_sum(1), args.iters,
                 args.warmup)
    many = timed(lambda: None, lambda: ready(chained(x)), check_sum(1), args.iters // 10,
                 args.warmup // 10)
    if hvd.rank() == 0:
        report("hvd.jax.allreduce (eager)", args.elements, n, eager)
        report("hvd.jax.allreduce (jax.jit)", args.elements, n, one)
        report("jax.jit(identity) without hvd", args.elements, n, call)
        calls = sorted(call)[::10][:len(many)]
        beyond = [(m - c) / args.chain for m, c in zip(sorted(many), calls)]
        report(f"hvd.jax.allreduce in a jax.jit of {args.chain}, each, beyond the call",
               args.elements, n, beyond)
    hvd.shutdown()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--elements", type=int, default=1)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--framework", choices=["torch", "tensorflow", "jax"], default="torch")
    p.add_argument("--chain", type=int, default=100,
                   help="allreduces in one tf.function, to time one beyond the call")
    args = p.parse_args()
    if args.framework == "torch":
        torch_latency(args)
    elif args.framework == "tensorflow":
        tensorflow_latency(args)
    else:
        jax_latency(args)


if __name__ == "__main__":
    main()
