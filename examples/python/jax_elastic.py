"""Elastic training with JAX on hvd: a small Flax MLP on a generated two-class dataset, with
optax through ``hvd.jax.DistributedOptimizer``, ``hvd.jax.elastic.JaxState`` and
``ElasticSampler``.

    horovodrun -np 4 --min-np 2 --host-discovery-script ./discover.sh \\
        python examples/python/jax_elastic.py --epochs 5

Kill a worker or change the hosts while it trains: the job goes on at the new size. The
training step is one ``jax.jit`` function whose gradient allreduce runs inside it. After each
epoch rank 0 prints the loss and accuracy on the whole dataset and checks the sampler:
across every rank and every reset of the epoch, each sample was trained on (none skipped; a
sample repeated only as padding, when the samples left do not divide evenly over the ranks),
and every rank holds the same parameters. Lines are JSON, one per epoch, then one "done".
"""

import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import hvd.jax as hvd


def dataset(n, seed=0):
    """Two Gaussian blobs in 8 dimensions, labels 0 and 1."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.standard_normal((n, 8)).astype(np.float32) + ((y * 2 - 1) * 0.8)[:, None]
    return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(32)(x)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the size")
    p.add_argument("--commit-every", type=int, default=4, help="batches between commits")
    p.add_argument("--batch-ms", type=float, default=0, help="sleep per batch (demos)")
    args = p.parse_args()

    hvd.init()
    x, y = dataset(args.samples)
    model = MLP()
    # Each rank's own start; the state's first sync gives every rank rank 0's (and a worker
    # that joins later the newest commit), so no broadcast is needed here.
    params = model.init(jax.random.PRNGKey(hvd.rank()), x[:1])

    def optimizer():
        # The learning rate follows the world's size; optax's state does not depend on it.
        return hvd.DistributedOptimizer(optax.sgd(args.lr * hvd.size(), momentum=0.9))

    tx = optimizer()
    sampler = hvd.elastic.ElasticSampler(list(range(args.samples)), shuffle=True, seed=1)
    state = hvd.elastic.JaxState(params=params, opt_state=tx.init(params), sampler=sampler,
                                 epoch=0, steps=0, trained=[])

    def loss_fn(p, xb, yb):
        logits = model.apply(p, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    def make_step(tx):
        @jax.jit
        def step(p, opt_state, xb, yb):
            grads = jax.grad(loss_fn)(p, xb, yb)
            # The allreduce runs inside the compiled step (DistributedOptimizer's update).
            updates, opt_state = tx.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state

        return step

    step = [make_step(tx)]

    def on_reset():
        step[0] = make_step(optimizer())

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        # This rank's samples since the last commit; a failure rolls them back, so they are
        # only recorded (for every rank, in the committed state) at a commit.
        pending = []

        def commit():
            state.trained.extend(i for part in hvd.allgather_object(pending) for i in part)
            pending.clear()
            state.commit()

        while state.epoch < args.epochs:
            indices = list(state.sampler)
            for b, start in enumerate(range(0, len(indices), args.batch_size)):
                idx = np.asarray(indices[start:start + args.batch_size])
                state.params, state.opt_state = step[0](state.params, state.opt_state,
                                                        x[idx], y[idx])
                state.steps += 1
                pending.extend(int(i) for i in idx)
                state.sampler.record_indices(idx)
                if args.batch_ms:
                    time.sleep(args.batch_ms / 1000)
                if b % args.commit_every == args.commit_every - 1:
                    commit()
            commit()
            # Every rank's samples of the epoch, through every reset of it.
            missing = sorted(set(range(args.samples)) - set(state.trained))
            logits = model.apply(state.params, x)
            loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())
            accuracy = float((logits.argmax(1) == y).mean())
            # Every rank holds the same parameters: training stayed in step.
            norm = jnp.float32(sum(float(jnp.sum(jnp.abs(leaf)))
                                   for leaf in jax.tree_util.tree_leaves(state.params)))
            spread = float(hvd.allreduce(norm, op=hvd.Max) - hvd.allreduce(norm, op=hvd.Min))
            if hvd.rank() == 0:
                print(json.dumps({"event": "epoch", "epoch": state.epoch, "size": hvd.size(),
                                  "loss": round(loss, 4), "accuracy": round(accuracy, 4),
                                  "samples": args.samples, "missing": len(missing),
                                  "repeated": len(state.trained) - len(set(state.trained)),
                                  "steps": state.steps, "params_spread": spread}),
                      flush=True)
            if missing:
                raise SystemExit(f"epoch {state.epoch}: {len(missing)} samples were never "
                                 f"trained on, first {missing[:5]}")
            state.epoch += 1
            state.trained = []
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        print(json.dumps({"event": "done", "epochs": args.epochs, "size": hvd.size(),
                          "steps": state.steps}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
