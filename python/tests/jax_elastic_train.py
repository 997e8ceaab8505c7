"""An elastic JAX job that proves no committed step is lost or applied twice, for the tests
and ``elastic_bench``: the ``elastic_counter`` events (``counter.py``) from a ``JaxState``
holding a one-weight model trained by optax through ``hvd.jax.DistributedOptimizer`` (its
update jitted, the allreduce inside it), an ``ElasticSampler`` and the counter.

Each step allreduces ones (the world's size) into ``total`` and appends the size to
``history``; the weight gets gradient 1 on every rank, so plain SGD with learning rate 1 takes
it to exactly ``-step``. ``--state-params N`` adds N float32 parameters with SGD momentum to
the state (11,689,512 is ResNet-18's count), to time recovery with a real state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import counter
import hvd.jax as hvd


def main():
    p = counter.parser(__doc__)
    p.add_argument("--state-params", type=int, default=0,
                   help="float32 parameters (with momentum) kept in the state besides the "
                        "counter")
    args = p.parse_args()
    counter.start()
    hvd.init()
    tx = hvd.DistributedOptimizer(optax.sgd(1.0))
    params = {"w": jnp.zeros((), jnp.float32)}
    extra = {}
    if args.state_params:
        # Layers of ResNet-like sizes; momentum state as SGD with momentum keeps it.
        sizes, left = [], args.state_params
        while left > 0:
            sizes.append(min(left, 2_359_296))
            left -= sizes[-1]
        big = {f"layer{i}": jnp.zeros((n,), jnp.float32) for i, n in enumerate(sizes)}
        extra = {"big": big, "big_momentum": jax.tree_util.tree_map(jnp.zeros_like, big)}
    sampler = hvd.elastic.ElasticSampler(list(range(64)), shuffle=True, seed=7)
    state = hvd.elastic.JaxState(params=params, opt_state=tx.init(params), sampler=sampler,
                                 step=0, total=0, history=[], **extra)

    @jax.jit
    def step(params, opt_state):
        grads = {"w": jnp.ones((), jnp.float32)}
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    calls = [0]
    resets = [0]
    state.register_reset_callbacks([lambda: resets.__setitem__(0, resets[0] + 1)])

    @hvd.elastic.run
    def train(state):
        rank, size = hvd.rank(), hvd.size()
        counter.entered(calls, state, rank, size)
        while state.step < args.steps:
            ones = hvd.allreduce(jnp.ones(16, dtype=jnp.int32), op=hvd.Sum)
            if not np.all(np.asarray(ones) == size):
                raise SystemExit(f"rank {rank}: allreduce of ones gave {ones} in a world of "
                                 f"{size}")
            # Every rank takes the next batch of its part of the epoch.
            counter.take_batch(state.sampler, 64)
            state.params, state.opt_state = step(state.params, state.opt_state)
            counter.stepped(state, rank, size)
            counter.commit_or_check(state, args, rank)
        return rank, size

    rank, size = train(state)
    counter.done(state, float(np.asarray(state.params["w"])), rank, size, resets[0],
                 args.steps)
    hvd.shutdown()


if __name__ == "__main__":
    main()
