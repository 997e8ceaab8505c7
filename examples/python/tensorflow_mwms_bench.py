"""TensorFlow on hvd against TensorFlow's own MultiWorkerMirroredStrategy (MWMS, ring
collectives), same model, batch and step on the same machine, in two figures:

- ``--mode train``: the step of Horovod's ``tensorflow2_synthetic_benchmark.py`` (a
  ``keras.applications`` model, ResNet50 by default, on random images, SGD 0.01), timed as it
  times it: img/sec per worker over ``--num-iters`` iterations of ``--num-batches-per-iter``
  batches, after ``--num-warmup-batches``;
- ``--mode sync``: the synchronisation of a gradient set shaped as the model's trainable
  variables (ResNet50: 214 tensors, 25.6 M float32), averaged by MWMS's
  ``ReplicaContext.all_reduce`` inside ``strategy.run``, or by ``hvd.grouped_allreduce``.

MWMS: the script starts its own ``--workers`` local workers (``TF_CONFIG`` on free loopback
ports, ``CommunicationImplementation.RING``); hvd: run it under ``horovodrun`` with ``--hvd``:

    python examples/python/tensorflow_mwms_bench.py --workers 2 --batch-size 8
    horovodrun -np 2 -H 127.0.0.1:2 python examples/python/tensorflow_mwms_bench.py --hvd \\
        --batch-size 8
    python examples/python/tensorflow_mwms_bench.py --workers 2 --mode sync
    horovodrun -np 2 -H 127.0.0.1:2 python examples/python/tensorflow_mwms_bench.py --hvd \\
        --mode sync

Each worker runs ``--threads`` TensorFlow threads (1 by default: workers share this machine's
cores). The first worker prints the figure and a last line of JSON for scripts; every worker
checks the averaged gradients in ``--mode sync``.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

WORKER_ENV = "HVD_MWMS_BENCH_WORKER"


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hvd", action="store_true", help="hvd.tensorflow (run under horovodrun)")
    p.add_argument("--workers", type=int, default=2, help="MWMS: local workers to start")
    p.add_argument("--mode", choices=["train", "sync", "both"], default="train",
                   help="both: train, then sync, in one job")
    p.add_argument("--model", default="ResNet50", help="a keras.applications model")
    p.add_argument("--batch-size", type=int, default=8, help="images per worker per batch")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-warmup-batches", type=int, default=2)
    p.add_argument("--num-batches-per-iter", type=int, default=2)
    p.add_argument("--num-iters", type=int, default=5, help="timed iterations (or syncs)")
    p.add_argument("--threads", type=int, default=1, help="TensorFlow threads per worker")
    p.add_argument("--timeout", type=float, default=600, help="MWMS: seconds for the workers")
    return p.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args):
    """Starts ``--workers`` copies of this script as one MWMS cluster; returns the exit code
    (the first failure's, after ending the others)."""
    hosts = [f"127.0.0.1:{free_port()}" for _ in range(args.workers)]
    procs = []
    for i in range(args.workers):
        config = {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}}
        env = dict(os.environ, TF_CONFIG=json.dumps(config), **{WORKER_ENV: "1"})
        procs.append(subprocess.Popen([sys.executable, *sys.argv], env=env))
    deadline = time.monotonic() + args.timeout
    code = 0
    while procs:
        for p in list(procs):
            rc = p.poll()
            if rc is None:
                continue
            procs.remove(p)
            if rc != 0 and code == 0:
                code = rc
        if code != 0 or time.monotonic() > deadline:
            # A worker that died leaves its peers waiting in a collective: end them.
            for p in procs:
                p.kill()
                p.wait()
            return code or 124
        time.sleep(0.05)
    return code


class Hvd:
    """hvd.tensorflow: Horovod's DistributedGradientTape and grouped_allreduce."""

    name = "hvd"

    def __init__(self):
        import hvd.tensorflow as hvd

        hvd.init()
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()

    def scope(self):
        import contextlib

        return contextlib.nullcontext()

    def train_step(self, model, opt, data, target, loss_fn):
        import tensorflow as tf

        hvd = self.hvd

        @tf.function
        def batch():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(target, model(data, training=True)))
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        def step(first_batch):
            batch()
            if first_batch:
                # Rank 0's weights and optimizer state to every rank once the first step
                # made them, as Horovod's benchmark does (here eagerly, outside the graph).
                # Keras 3's optimizer variables are a property, Keras 2's a method.
                variables = opt.variables
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(variables() if callable(variables) else variables,
                                        root_rank=0)

        return step

    def sync(self, grads):
        import tensorflow as tf

        hvd = self.hvd

        @tf.function
        def run():
            return hvd.grouped_allreduce(grads, op=hvd.Average)

        return run

    def barrier(self):
        import tensorflow as tf

        self.hvd.allreduce(tf.constant(0.0), name="bench.barrier")


class Mwms:
    """tf.distribute.MultiWorkerMirroredStrategy over TF_CONFIG, ring collectives."""

    name = "MWMS (ring)"

    def __init__(self):
        import tensorflow as tf

        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        resolver = self.strategy.cluster_resolver
        self.rank = resolver.task_id
        self.size = self.strategy.num_replicas_in_sync

    def scope(self):
        return self.strategy.scope()

    def train_step(self, model, opt, data, target, loss_fn):
        import tensorflow as tf

        strategy, size = self.strategy, self.size

        def replica_step():
            with tf.GradientTape() as tape:
                # The mean over the global batch: the replicas' gradients are summed.
                loss = tf.reduce_sum(loss_fn(target, model(data, training=True))) / (
                    size * data.shape[0])
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def step(first_batch):
            # MWMS creates every variable mirrored and equal on every worker: no broadcast.
            del first_batch
            strategy.run(replica_step)

        return step

    def sync(self, grads):
        import tensorflow as tf

        strategy = self.strategy

        def replica_sync():
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce(tf.distribute.ReduceOp.MEAN, grads)

        @tf.function
        def run():
            return strategy.run(replica_sync)

        return run

    def barrier(self):
        import tensorflow as tf

        def one():
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(0.0))

        self.strategy.run(tf.function(one))


def train(args, system, tf):
    with system.scope():
        model = getattr(tf.keras.applications, args.model)(
            weights=None, input_shape=(args.image_size, args.image_size, 3))
        opt = tf.keras.optimizers.SGD(0.01)
        opt.build(model.trainable_variables)
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)
    step = system.train_step(model, opt, data, target,
                             tf.keras.losses.sparse_categorical_crossentropy)
    log = print if system.rank == 0 else (lambda *a, **k: None)
    log(f"{system.name}: model {args.model}, batch {args.batch_size} of {args.image_size}px "
        f"per worker, {system.size} workers, {args.threads} thread(s) each", flush=True)
    step(True)
    for _ in range(args.num_warmup_batches):
        step(False)
    rates = []
    for i in range(args.num_iters):
        t = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step(False)
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - t)
        log(f"iter #{i}: {rate:.1f} img/sec per worker", flush=True)
        rates.append(rate)
    mean = statistics.mean(rates)
    conf = 1.96 * (statistics.stdev(rates) if len(rates) > 1 else 0.0)
    size = system.size
    log(f"img/sec per worker: {mean:.1f} +-{conf:.1f}")
    log(f"total img/sec on {size} worker(s): {size * mean:.1f} +-{size * conf:.1f}")
    log(json.dumps({"system": system.name, "mode": "train", "model": args.model,
                    "batch_size": args.batch_size, "image_size": args.image_size,
                    "ranks": size, "img_sec_per_rank": mean, "img_sec_total": size * mean,
                    "conf": conf}), flush=True)


def sync(args, system, tf):
    import numpy as np

    model = getattr(tf.keras.applications, args.model)(
        weights=None, input_shape=(args.image_size, args.image_size, 3))
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    del model
    grads = [tf.fill(s, float(system.rank + 1)) for s in shapes]
    elems = sum(int(np.prod(s)) for s in shapes)
    run = system.sync(grads)
    want = (system.size + 1) / 2
    times = []
    for k in range(args.num_warmup_batches + args.num_iters):
        system.barrier()
        t = time.perf_counter()
        out = run()
        if k >= args.num_warmup_batches:
            times.append(time.perf_counter() - t)
        if isinstance(out, dict) or not isinstance(out, (list, tuple)):
            raise SystemExit(f"unexpected result {type(out)}")
        if len(out) != len(grads) or not all(
                np.allclose(o.numpy(), want, rtol=1e-5) for o in out):
            raise SystemExit(f"worker {system.rank}: the averaged gradients are wrong")
    if system.rank == 0:
        ms = statistics.median(times) * 1000
        print(f"{system.name}: {len(grads)} tensors, {elems} float32, {system.size} workers: "
              f"median {ms:.1f} ms per synchronisation over {args.num_iters}", flush=True)
        print(json.dumps({"system": system.name, "mode": "sync", "model": args.model,
                          "tensors": len(grads), "elems": elems, "ranks": system.size,
                          "median_ms": ms}), flush=True)


def main():
    args = parse()
    if not args.hvd and WORKER_ENV not in os.environ:
        return launch(args)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    system = Hvd() if args.hvd else Mwms()
    if args.mode in ("train", "both"):
        train(args, system, tf)
    if args.mode in ("sync", "both"):
        sync(args, system, tf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
