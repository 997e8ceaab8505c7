"""hvd.jax at any number of ranks: every collective on arrays and pytrees, eager and inside
jax.jit, checked against what each rank can compute alone; the gradient of an allreduce;
DistributedOptimizer on optax (with backward_passes_per_step and the predivide factor);
broadcast_parameters; and the refusals, which every rank must raise instead of waiting."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hvd.jax as hvd


def expect_error(what, fn, *needles):
    try:
        fn()
    except ValueError as e:
        for n in needles:
            assert n in str(e), f"{what}: {e}"
    else:
        raise AssertionError(f"{what}: no error")


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    cases = 0

    # allreduce on arrays, eager: every reduction, scale factors, dtypes.
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3) + r
    total = sum(np.arange(6, dtype=np.float32).reshape(2, 3) + q for q in range(n))
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum), total)
    np.testing.assert_allclose(hvd.allreduce(x), total / n, rtol=1e-6)
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Min), np.arange(6).reshape(2, 3))
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Max),
                               np.arange(6).reshape(2, 3) + n - 1)
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                             postscale_factor=0.5), total, rtol=1e-6)
    out = hvd.allreduce(x, op=hvd.Sum)
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32 and out.shape == (2, 3)
    for dtype in (jnp.int32, jnp.bfloat16, jnp.float16, jnp.uint8):
        y = hvd.allreduce(jnp.full((5,), r + 1, dtype=dtype), op=hvd.Sum)
        assert y.dtype == dtype, (dtype, y.dtype)
        np.testing.assert_allclose(np.asarray(y, dtype=np.float64), n * (n + 1) / 2)
    scalar = hvd.allreduce(jnp.float32(r), op=hvd.Sum)
    assert scalar.shape == () and float(scalar) == n * (n - 1) / 2
    cases += 9

    # A pytree, as one fused op; nested dicts, lists, tuples, a None left alone.
    tree = {"w": x, "b": [jnp.ones(3, jnp.bfloat16) * (r + 1), (jnp.int32(r), None)]}
    got = hvd.allreduce(tree, op=hvd.Sum)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(tree)
    np.testing.assert_allclose(got["w"], total)
    np.testing.assert_allclose(np.asarray(got["b"][0], np.float32), n * (n + 1) / 2)
    assert int(got["b"][1][0]) == n * (n - 1) // 2 and got["b"][1][1] is None
    grouped = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)
    np.testing.assert_allclose(grouped[1], total * 2)
    cases += 2

    # Inside jax.jit: the same results, through the ordered callback; and a training step's
    # usual shape, grads = allreduce(grad(loss)(params)).
    @jax.jit
    def reduce_tree(t):
        return hvd.allreduce(t, op=hvd.Sum)

    jitted = reduce_tree(tree)
    np.testing.assert_allclose(jitted["w"], total)
    assert int(jitted["b"][1][0]) == n * (n - 1) // 2
    params = {"w": jnp.ones((3,)) * 0.5, "b": jnp.zeros(())}
    data = jnp.arange(3, dtype=jnp.float32) + r

    def loss(p, d):
        return jnp.sum((p["w"] * d + p["b"]) ** 2)

    @jax.jit
    def grads_of(p, d):
        return hvd.allreduce(jax.grad(loss)(p, d))

    g = grads_of(params, data)
    ref = [jax.grad(loss)(params, jnp.arange(3, dtype=jnp.float32) + q) for q in range(n)]
    np.testing.assert_allclose(g["w"], sum(t["w"] for t in ref) / n, rtol=1e-5)
    np.testing.assert_allclose(g["b"], sum(t["b"] for t in ref) / n, rtol=1e-5)
    # Differentiable as Horovod's: the gradient of an allreduce is the same allreduce of the
    # output's gradient (here ones on every rank, so ones), then this rank's chain rule.
    dg = jax.jit(jax.grad(lambda v: jnp.sum(hvd.allreduce(v * (r + 1.0)))))(x)
    np.testing.assert_allclose(dg, np.full((2, 3), r + 1.0), rtol=1e-6)
    dg = jax.grad(lambda v: jnp.sum(hvd.allreduce(v * v, op=hvd.Sum)))(x)
    np.testing.assert_allclose(dg, 2 * n * x, rtol=1e-6)
    cases += 3

    # allgather (rows may differ eagerly), broadcast, alltoall, reducescatter.
    rows = jnp.full((r + 1, 2), r, dtype=jnp.int32)
    gathered = hvd.allgather(rows)
    assert gathered.shape == (n * (n + 1) // 2, 2), gathered.shape
    np.testing.assert_array_equal(gathered[:, 0], np.repeat(np.arange(n), np.arange(1, n + 1)))
    same = jax.jit(lambda a: hvd.allgather(a))(jnp.full((2, 2), r, jnp.float32))
    np.testing.assert_array_equal(same[:, 0], np.repeat(np.arange(n), 2))
    b = hvd.broadcast({"a": x, "flag": jnp.array([r == 0, True])}, root_rank=n - 1)
    np.testing.assert_allclose(b["a"], np.arange(6).reshape(2, 3) + n - 1)
    assert b["flag"].dtype == jnp.bool_ and bool(b["flag"][0]) == (n == 1)
    jb = jax.jit(lambda a: hvd.broadcast(a, 0))(x)
    np.testing.assert_allclose(jb, np.arange(6).reshape(2, 3))
    sent = jnp.arange(2 * n, dtype=jnp.float32) + 100 * r
    got, received = hvd.alltoall(sent)
    np.testing.assert_allclose(got, np.concatenate(
        [np.arange(2 * r, 2 * r + 2) + 100 * q for q in range(n)]))
    assert list(np.asarray(received)) == [2] * n
    rs = hvd.reducescatter(jnp.ones((n * 2 + 1, 3)) * (r + 1), op=hvd.Sum)
    assert rs.shape == (2 + (1 if r < 1 else 0), 3), rs.shape
    np.testing.assert_allclose(rs, n * (n + 1) / 2)
    cases += 6

    # Objects, barrier.
    assert hvd.broadcast_object({"from": r}, root_rank=0) == {"from": 0}
    assert hvd.allgather_object(r * 10) == [q * 10 for q in range(n)]
    hvd.barrier()
    cases += 2

    # broadcast_parameters: every rank starts from rank 0's pytree.
    mine = {"dense": {"kernel": jnp.full((2, 2), float(r)), "bias": jnp.full((2,), r)},
            "step": jnp.int32(r)}
    synced = hvd.broadcast_parameters(mine, root_rank=0)
    np.testing.assert_allclose(synced["dense"]["kernel"], 0.0)
    assert int(synced["step"]) == 0
    cases += 1

    # DistributedOptimizer: the update of the averaged gradients, eager and jitted.
    tx = hvd.DistributedOptimizer(optax.sgd(0.1))
    state = tx.init(params)
    grads = {"w": jnp.full((3,), float(r)), "b": jnp.float32(r)}
    updates, state = tx.update(grads, state, params)
    np.testing.assert_allclose(updates["w"], -0.1 * (n - 1) / 2, rtol=1e-6)

    @jax.jit
    def step(p, s, gr):
        u, s = tx.update(gr, s, p)
        return optax.apply_updates(p, u), s

    new, state = step(params, state, grads)
    np.testing.assert_allclose(new["w"], 0.5 - 0.1 * (n - 1) / 2, rtol=1e-6)
    # backward_passes_per_step: the gradients of 2 calls summed, then reduced and applied.
    tx2 = hvd.DistributedOptimizer(optax.sgd(1.0), backward_passes_per_step=2)
    s2 = tx2.init(params)
    u1, s2 = tx2.update(grads, s2, params)
    np.testing.assert_allclose(u1["w"], 0.0)
    u2, s2 = tx2.update(grads, s2, params)
    np.testing.assert_allclose(u2["w"], -2.0 * (n - 1) / 2, rtol=1e-6)
    tx3 = hvd.DistributedOptimizer(optax.sgd(1.0), gradient_predivide_factor=2.0)
    u3, _ = tx3.update(grads, tx3.init(params), params)
    np.testing.assert_allclose(u3["w"], -(n - 1) / 2, rtol=1e-6)
    cases += 4

    # Refusals, on every rank at once, before anything waits on a peer.
    expect_error("int8", lambda: hvd.allreduce(jnp.ones(2, jnp.int8)), "int8", "cast")
    expect_error("adasum ints", lambda: hvd.allreduce(jnp.ones(2, jnp.int32), op=hvd.Adasum),
                 "floating")
    expect_error("op", lambda: hvd.allreduce(x, op="sum"), "unknown reduction")
    expect_error("int scale", lambda: hvd.allreduce(jnp.ones(2, jnp.int32), op=hvd.Sum,
                                                    prescale_factor=0.5),
                 "prescale_factor", "floating-point", "int32")
    if n > 1:
        # Mismatched pytrees across ranks: the same clear error on every rank, no hang.
        odd = {"w": x} if r == 0 else {"w": x, "extra": x}
        expect_error("structure", lambda: hvd.allreduce(odd), "different pytrees")
        shaped = {"w": jnp.ones((r + 1,))}
        expect_error("shapes", lambda: hvd.broadcast_parameters(shaped), "different pytrees")
    cases += 6

    hvd.barrier()
    print(f"jax ok: rank {r} of {n}, {cases} cases", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
