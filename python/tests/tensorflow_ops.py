"""Every collective of ``hvd.tensorflow`` against a reference computed here, eagerly and
inside ``tf.function``, run under ``horovodrun -np N`` (1 to 3 ranks): every dtype and
op, gradients, ``DistributedGradientTape``, the legacy ``DistributedOptimizer``, process
sets and the errors. Every rank builds every rank's input from (rank, case) alone, so each
can compute the expected result itself.

Inside ``tf.function`` allreduces are hvd's compiled op, or ``numpy_function`` nodes where
it is turned off or cannot be built: ``HVD_TEST_GRAPH_OPS`` (``compiled``, the default, or
``numpy``) says which this run expects, and every graph-mode check runs on that path.

Prints ``tensorflow ok: rank R of N, C cases`` and exits 0, or raises.
"""

import os
import sys
import warnings

import numpy as np
import tensorflow as tf

import hvd.tensorflow as hvd
from hvd import elastic
from hvd.tensorflow import buffers, graph_ops

warnings.filterwarnings("ignore", category=DeprecationWarning)
# Every case traces functions of its own: TensorFlow's advice against retracing is moot.
tf.get_logger().setLevel("ERROR")

DTYPES = [tf.uint8, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64]
OPS = {hvd.Sum: "sum", hvd.Average: "average", hvd.Min: "min", hvd.Max: "max",
       hvd.Product: "product"}
# Element counts on both sides of the 32 KiB threshold between the small-call and ring paths.
COUNTS = [0, 1, 7, 1000, 20000]
# Element types that are only moved, never reduced: sent as their bytes.
MOVED_ONLY = [tf.bool, tf.int8, tf.int16, tf.uint16, tf.complex64]


def data(rank, case, count, dtype):
    """Rank ``rank``'s input of case ``case``: small values, so products stay exact."""
    v = np.random.RandomState(1000 * case + rank).randint(1, 4, count)
    if dtype == tf.bool:
        return tf.constant(v % 2 == 0)
    if dtype.is_complex:
        return tf.complex(tf.constant(v, tf.float32), tf.constant(-v, tf.float32))
    return tf.cast(tf.constant(v), dtype)


def wide(t):
    """``t`` as float64 (ints as int64) numpy, for comparisons."""
    if t.dtype.is_floating:
        return tf.cast(t, tf.float64).numpy()
    return t.numpy().astype(np.int64) if t.dtype.is_integer else t.numpy()


# Each reduction of a stack of inputs (float64, or int64 for ints), along the ranks.
REDUCE = {"sum": lambda xs: xs.sum(0), "average": lambda xs: xs.mean(0),
          "min": lambda xs: xs.min(0), "max": lambda xs: xs.max(0),
          "product": lambda xs: xs.prod(0)}


def reference(inputs, op, dtype):
    """The reduction of ``inputs``, computed in float64 (ints in int64; an integer average
    truncated, as hvd's), then cast."""
    r = REDUCE[op](np.stack([wide(x) for x in inputs]))
    if op == "average" and not dtype.is_floating:
        r = np.trunc(r)
    return tf.cast(tf.constant(r), dtype)


def close(got, want):
    if got.dtype in (tf.float16, tf.bfloat16):
        return np.allclose(wide(got), wide(want), rtol=1e-2, atol=1e-2)
    if got.dtype.is_floating:
        return np.allclose(wide(got), wide(want), rtol=1e-6, atol=1e-6)
    return got.shape == want.shape and np.array_equal(got.numpy(), want.numpy())


def both(fn, *args):
    """``fn(*args)`` run eagerly and inside a ``tf.function``."""
    return [fn(*args), tf.function(fn)(*args)]


def expect_error(call, kinds, *words):
    """``call()`` must raise one of ``kinds`` whose message holds every one of ``words``."""
    try:
        call()
    except kinds as e:
        text = str(e)
        assert all(w in text for w in words), (words, text)
        return e
    raise AssertionError(f"no error for {words}")


def check_before_init():
    expect_error(lambda: hvd.allreduce(tf.ones(2)), RuntimeError, "not initialized")
    expect_error(lambda: hvd.size(), RuntimeError, "not initialized")


def reductions(sizes, first=1):
    """(case, dtype, op, op's name, size) for every dtype and op, and every size that
    ``sizes(dtype, op's name)`` lists; cases numbered from ``first``."""
    cases = [(dtype, op, name, size) for dtype in DTYPES for op, name in OPS.items()
             for size in sizes(dtype, name)]
    return [(first + i,) + c for i, c in enumerate(cases)]


def allreduce_counts(dtype, name):
    """Element counts of the allreduce cases: products of uint8 and half precision only on
    short inputs (3^4 overflows a byte and half precision loses integers past 2^11)."""
    short = name == "product" and dtype in (tf.uint8, tf.float16, tf.bfloat16)
    return [1, 7] if short else COUNTS


def check_allreduce(r, n):
    cases = 0
    for case, dtype, op, name, count in reductions(allreduce_counts):
        inputs = [data(p, case, count, dtype) for p in range(n)]
        want = reference(inputs, name, dtype)
        mine = inputs[r]
        before = mine.numpy().copy()
        for mode, got in zip(("eager", "graph"),
                             both(lambda t: hvd.allreduce(t, op=op), mine)):
            assert got.dtype == dtype and got.shape == mine.shape, (mode, got)
            assert close(got, want), (mode, dtype, name, count, got[:8], want[:8])
        assert np.array_equal(mine.numpy(), before), "allreduce changed its input"
        cases += 1
    # A 4-byte allreduce, eager and in tf.function: the latency example's call.
    for got in both(lambda t: hvd.allreduce(t, op=hvd.Sum), tf.constant([float(r + 1)])):
        assert got.numpy().tolist() == [n * (n + 1) / 2], got
    # Variables, pre- and postscaling, the deprecated average flag, fp16 on the wire.
    v = tf.Variable(tf.ones(5, tf.float64))
    for got in both(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0,
                                            postscale_factor=0.5), v):
        assert np.array_equal(got.numpy(), np.full(5, float(n))), got
    assert np.array_equal(hvd.allreduce(v, average=False).numpy(), np.full(5, float(n)))
    assert np.array_equal(hvd.allreduce(v).numpy(), np.ones(5)), "the default is the average"
    for got in both(lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16),
                    tf.fill([4], float(r + 1))):
        assert got.dtype == tf.float32 and np.allclose(got.numpy(), n * (n + 1) / 2), got
    # Adasum of equal vectors is that vector.
    same = tf.constant([1.0, -2.0, 3.0], tf.float64)
    for got in both(lambda t: hvd.allreduce(t, op=hvd.Adasum), same):
        assert np.allclose(got.numpy(), same.numpy()), got
    # The eager call's own path, one native call with DLPack both ways: every reducible
    # type takes it, in every shape, and its result owns fresh memory that TensorFlow's
    # kernels can read; what it cannot take goes the general way.
    for i, dtype in enumerate(DTYPES):
        for shape in ([], [0], [2, 3], [1, 4, 1]):
            x = tf.reshape(tf.cast(tf.range(int(np.prod(shape))) % 3, dtype), shape)
            got = buffers.allreduced(x, hvd.Sum)
            assert got is not None and got.dtype == dtype and got.shape == shape, (dtype, got)
            assert close(got, reference([x] * n, "sum", dtype)), (dtype, shape, got)
            assert not shape or 0 in shape or got._numpy().ctypes.data % 64 == 0
            assert tf.reduce_all(x == tf.reshape(tf.cast(tf.range(int(np.prod(shape))) % 3,
                                                         dtype), shape)), "input changed"
            cases += 1
    for other in (tf.constant([1], tf.int8), tf.constant(["a"]), tf.constant([True])):
        assert buffers.allreduced(other, hvd.Sum) is None, other.dtype
    # Inputs that live in an eager tensor's memory come back as tensors over hvd's arrays.
    out, at = buffers._arrays.aligned((3,), np.float32)
    assert buffers.tensor_of(out, aligned=True)._numpy().ctypes.data == at
    bf = buffers._arrays.empty((3,), tf.bfloat16.as_numpy_dtype)
    assert buffers.tensor_of(bf)._numpy().ctypes.data == bf.ctypes.data
    return cases + 5


def check_sparse_and_grouped(r, n):
    # IndexedSlices: values and indices gathered, an average divides the values.
    s = tf.IndexedSlices(tf.fill([r + 1, 2], float(r + 1)), tf.range(r + 1),
                         dense_shape=tf.constant([10, 2]))
    values = np.concatenate([np.full((p + 1, 2), float(p + 1)) for p in range(n)])
    indices = np.concatenate([np.arange(p + 1) for p in range(n)])
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        for got in both(lambda x: hvd.allreduce(x, op=op), s):
            assert isinstance(got, tf.IndexedSlices), got
            assert np.allclose(got.values.numpy(), values * scale), got.values
            assert np.array_equal(got.indices.numpy(), indices), got.indices
    expect_error(lambda: hvd.allreduce(s, op=hvd.Max), NotImplementedError, "Sum", "Average")
    # grouped: mixed dtypes and an IndexedSlices, as one op.
    group = [tf.fill([k + 1], float(r + k)) for k in range(6)] + \
        [tf.fill([3], r + 1), s]
    for outs in both(lambda *g: hvd.grouped_allreduce(list(g), op=hvd.Sum), *group):
        for k in range(6):
            assert np.array_equal(outs[k].numpy(),
                                  np.full(k + 1, n * (n - 1) / 2 + n * k)), (k, outs[k])
        assert np.array_equal(outs[6].numpy(), np.full(3, n * (n + 1) // 2)), outs[6]
        assert np.array_equal(outs[7].indices.numpy(), indices), outs[7]
    avg = hvd.grouped_allreduce([tf.fill([2], float(r)), tf.fill([1], 2.0 * r)],
                                compression=hvd.Compression.fp16, postscale_factor=2.0)
    assert np.allclose(avg[0].numpy(), n - 1.0) and np.allclose(avg[1].numpy(), 2 * (n - 1.0))
    assert hvd.grouped_allreduce([]) == []
    return 3


def check_movers(r, n):
    """allgather, broadcast, alltoall of every dtype (the moved-only ones as bytes)."""
    cases = 0
    case = 5000
    for dtype in DTYPES + MOVED_ONLY:
        case += 1
        parts = [tf.reshape(data(p, case, 3 * (p + 1), dtype), [p + 1, 3]) for p in range(n)]
        want = tf.concat(parts, 0)
        for got in both(hvd.allgather, parts[r]):
            assert got.dtype == dtype and np.array_equal(got.numpy(), want.numpy()), (dtype, got)
        for root in range(n):
            ins = [data(p, case + root, 100, dtype) for p in range(n)]
            for got in both(lambda t: hvd.broadcast(t, root), ins[r]):
                assert np.array_equal(got.numpy(), ins[root].numpy()), (dtype, root)
        # alltoall: rank p sends (p + q) % 3 rows to rank q.
        sends = {p: [(p + q) % 3 for q in range(n)] for p in range(n)}
        ins = {p: tf.reshape(data(p, case, 2 * sum(sends[p]), dtype), [-1, 2])
               for p in range(n)}
        rows = []
        for p in range(n):
            start = sum(sends[p][:r])
            rows.append(ins[p][start:start + sends[p][r]])
        for out, received in both(lambda t, s: hvd.alltoall(t, splits=s), ins[r],
                                  tf.constant(sends[r])):
            assert np.array_equal(out.numpy(), tf.concat(rows, 0).numpy()), (dtype, out)
            assert received.dtype == tf.int32
            assert received.numpy().tolist() == [sends[p][r] for p in range(n)], received
        cases += 1
    for even in both(lambda t: hvd.alltoall(t), tf.range(2 * n) + 100 * r):
        assert even.numpy().tolist() == [100 * p + 2 * r + k for p in range(n)
                                         for k in range(2)], even
    assert hvd.allgather_object({"rank": r}) == [{"rank": p} for p in range(n)]
    assert hvd.broadcast_object(("from", r), root_rank=n - 1) == ("from", n - 1)
    return cases + 2


def check_reducescatter(r, n):
    cases = 0
    # Row counts below, at and past a multiple of the ranks; for products, one of each shape
    # is enough for their overflow.
    def row_counts(dtype, name):
        return [rows for rows in (1, n, n + 1, 3 * n + 2) if name != "product" or rows <= n + 1]

    for case, dtype, op, name, rows in reductions(row_counts, first=9000):
        inputs = [tf.reshape(data(p, case, rows * 6, dtype), [rows, 2, 3])
                  for p in range(n)]
        want = reference([tf.reshape(i, [-1]) for i in inputs], name, dtype)
        want = tf.reshape(want, [rows, 2, 3])
        base, extra = divmod(rows, n)
        start = r * base + min(r, extra)
        mine = want[start:start + base + (1 if r < extra else 0)]
        for got in both(lambda t: hvd.reducescatter(t, op=op), inputs[r]):
            assert got.shape == mine.shape, (dtype, name, rows, got.shape, mine.shape)
            assert close(tf.reshape(got, [-1]), tf.reshape(mine, [-1])), \
                (dtype, name, rows)
        cases += 1
    x = tf.ones([2 * n, 3])
    for got in both(lambda t: hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0,
                                                postscale_factor=0.25), x):
        assert np.array_equal(got.numpy(), np.full((2, 3), n / 2.0)), got
    assert np.array_equal(x.numpy(), np.ones((2 * n, 3))), "reducescatter changed its input"
    return cases + 1


def grads_of(fn, x):
    """The gradient of ``sum(fn(x) * weights)`` with respect to ``x``, eagerly and inside a
    ``tf.function``."""
    def grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            w = tf.reshape(tf.range(1, tf.size(y) + 1, dtype=y.dtype), tf.shape(y))
            loss = tf.reduce_sum(y * w)
        return tape.gradient(loss, x)

    return both(grad, x)


def check_gradients(r, n):
    x = tf.fill([3], float(r + 1))
    w = np.arange(1, 4, dtype=np.float32)
    for g in grads_of(lambda t: hvd.allreduce(t, op=hvd.Sum), x):
        assert np.array_equal(g.numpy(), w * n), g
    for g in grads_of(hvd.allreduce, x):
        assert np.allclose(g.numpy(), w), g
    for g in grads_of(lambda t: hvd.grouped_allreduce([t, t * 2.0], op=hvd.Sum)[1], x):
        assert np.array_equal(g.numpy(), 2 * w * n), g
    # allgather: this rank's rows of the averaged gradient (the weights are alike on every
    # rank, so their average).
    rows = tf.fill([r + 1, 2], float(r))
    total = n * (n + 1) // 2
    weights = np.arange(1, 2 * total + 1, dtype=np.float32).reshape(total, 2)
    start = r * (r + 1) // 2
    for g in grads_of(hvd.allgather, rows):
        assert np.array_equal(g.numpy(), weights[start:start + r + 1]), g
    # broadcast: the averaged gradient on the root, zeros elsewhere.
    for g in grads_of(lambda t: hvd.broadcast(t, 0), x):
        assert np.array_equal(g.numpy(), w if r == 0 else np.zeros(3)), g
    # alltoall: the gradient comes back by the reverse alltoall.
    sends = tf.constant([1] * n)
    for g in grads_of(lambda t: hvd.alltoall(t, splits=sends)[0], tf.fill([n], float(r))):
        assert np.array_equal(g.numpy(), np.full(n, r + 1.0)), g
    # reducescatter: the allgather of the gradient, times the ranks for a sum (Horovod's).
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        for g in grads_of(lambda t: hvd.reducescatter(t, op=op), tf.ones([2 * n])):
            assert np.array_equal(g.numpy(), np.tile([1.0, 2.0], n) * factor), (op, g)
    return 8


def model_loss(w, b, r):
    """A loss whose gradient differs per rank: rank r's batch is (r + 1) * ones."""
    xb = tf.fill([4, 3], float(r + 1))
    return tf.reduce_sum(tf.matmul(xb, w) + b) ** 2 / 100.0


def local_grads(w, b, p):
    with tf.GradientTape() as tape:
        loss = model_loss(w, b, p)
    return tape.gradient(loss, [w, b])


def check_tape_and_optimizer(r, n):
    w = tf.Variable(tf.reshape(tf.range(6, dtype=tf.float32), [3, 2]) / 10.0)
    b = tf.Variable(tf.zeros([2]))
    per_rank = [local_grads(w, b, p) for p in range(n)]
    mean = [np.mean([g[i].numpy() for g in per_rank], 0) for i in range(2)]
    total = [np.sum([g[i].numpy() for g in per_rank], 0) for i in range(2)]
    options = [({}, mean), ({"groups": 2}, mean), ({"groups": [[b]]}, mean),
               ({"op": hvd.Sum}, total), ({"gradient_predivide_factor": 2.0}, mean),
               ({"compression": hvd.Compression.fp16}, mean), ({"num_groups": 1}, mean)]
    for kwargs, want in options:
        def step():
            with tf.GradientTape() as tape:
                loss = model_loss(w, b, r)
            tape = hvd.DistributedGradientTape(tape, **kwargs)
            return tape.gradient(loss, [w, b])

        for grads in both(step):
            for g, m in zip(grads, want):
                assert np.allclose(g.numpy(), m, rtol=1e-2), (kwargs, g, m)
    # A local source keeps its own gradient, divided by the ranks.
    with tf.GradientTape() as tape:
        loss = model_loss(w, b, r)
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(b)
    gw, gb = tape.gradient(loss, [w, b])
    assert np.allclose(gw.numpy(), mean[0]) and np.allclose(gb.numpy(), per_rank[r][1] / n)
    # Unscaled with scale_local_gradients=False; split by get_local_and_global_gradients;
    # the same inside a tf.function.
    for scale in (True, False):
        def split():
            with tf.GradientTape() as tape:
                loss = model_loss(w, b, r)
            tape = hvd.DistributedGradientTape(tape, scale_local_gradients=scale)
            tape.register_local_source(b)
            local, shared = tape.get_local_and_global_gradients(loss, [w, b])
            assert [s is b for s, _ in local] == [True] and [s is w for s, _ in shared] == [True]
            return local[0][1], shared[0][1]

        for gb, gw in both(split):
            want_b = per_rank[r][1] / n if scale else per_rank[r][1]
            assert np.allclose(gb.numpy(), want_b), (scale, gb, want_b)
            assert np.allclose(gw.numpy(), mean[0]), (scale, gw)
    # Sparse gradients (an embedding lookup): allgathered, or dense with sparse_as_dense.
    emb = tf.Variable(tf.ones([5, 2]))
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [r % 5, 4]) * float(r + 1))
        g = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(
            loss, [emb])[0]
        assert isinstance(g, tf.IndexedSlices) != sparse_as_dense, type(g)
        want = np.zeros([5, 2])
        for p in range(n):
            want[p % 5] += (p + 1) / n
            want[4] += (p + 1) / n
        assert np.allclose(tf.convert_to_tensor(g).numpy(), want), (sparse_as_dense, g)
    # The legacy optimizer steps every rank by the averaged gradient; Keras's is refused.
    w0 = w.numpy().copy()
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
    opt.minimize(lambda: model_loss(w, b, r), var_list=[w, b])
    assert np.allclose(w.numpy(), w0 - 0.5 * mean[0]), (w.numpy(), w0 - 0.5 * mean[0])
    # ... but a local variable by its own gradient (divided by the ranks unless told not to).
    for scale in (True, False):
        b.assign(tf.fill([2], 0.5))  # the same on every rank: a local step makes it differ
        w0, b0 = w.numpy().copy(), b.numpy().copy()
        now = [local_grads(w, b, p) for p in range(n)]
        mean_w = np.mean([g[0].numpy() for g in now], 0)
        own = now[r][1].numpy() * (1 / n if scale else 1)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5),
                                       scale_local_gradients=scale)
        opt.register_local_var(b)
        opt.minimize(lambda: model_loss(w, b, r), var_list=[w, b])
        assert np.allclose(b.numpy(), b0 - 0.5 * own), (scale, b.numpy(), b0 - 0.5 * own)
        assert np.allclose(w.numpy(), w0 - 0.5 * mean_w), (scale, w.numpy())
    expect_error(lambda: hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), ValueError,
                 "hvd.tensorflow.keras.DistributedOptimizer")
    expect_error(lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum,
                                                      gradient_predivide_factor=2.0),
                 ValueError, "gradient_predivide_factor")
    return len(options) + 8


def check_variables(r, n):
    vs = [tf.Variable(tf.fill([k + 2], float(r + k))) for k in range(3)] + \
        [tf.Variable(tf.fill([2], r)), tf.Variable([r == 0, r == 1])]
    hvd.broadcast_variables(vs, root_rank=n - 1)
    for k in range(3):
        assert np.array_equal(vs[k].numpy(), np.full(k + 2, n - 1.0 + k)), vs[k]
    assert vs[3].numpy().tolist() == [n - 1] * 2
    assert vs[4].numpy().tolist() == [n == 1, n == 2]
    ws = [tf.Variable(tf.fill([3], float(r))), tf.Variable(tf.fill([1], r * 10))]
    @tf.function
    def in_graph():
        hvd.broadcast_variables(ws, root_rank=0)

    in_graph()
    assert ws[0].numpy().tolist() == [0.0] * 3 and ws[1].numpy().tolist() == [0]
    u = tf.Variable(tf.fill([2], float(r)))
    for values in both(lambda: hvd.broadcast_([u], root_rank=n - 1)):
        assert values[0].numpy().tolist() == [n - 1.0] * 2 and \
            u.numpy().tolist() == [n - 1.0] * 2, (values, u)
    return 3


def check_process_sets(r, n):
    even = hvd.add_process_set([p for p in range(n) if p % 2 == 0])
    odd = hvd.add_process_set([p for p in range(n) if p % 2 == 1]) if n > 1 else None
    mine, other = (even, odd) if r % 2 == 0 else (odd, even)
    k, m = mine.rank(), mine.size()
    for got in both(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=mine), tf.ones(3)):
        assert np.array_equal(got.numpy(), np.full(3, float(m))), got
    for got in both(lambda t: hvd.allreduce(t, process_set=mine), tf.fill([2], float(r))):
        assert np.allclose(got.numpy(), sum(mine.ranks) / m), got
    for outs in both(lambda a, c: hvd.grouped_allreduce([a, c], op=hvd.Sum, process_set=mine),
                     tf.ones(2), tf.fill([1], r)):
        assert outs[0].numpy().tolist() == [m] * 2 and outs[1].numpy().tolist() == \
            [sum(mine.ranks)], outs
    for got in both(lambda t: hvd.broadcast(t, mine.ranks[-1], process_set=mine),
                    tf.fill([4], float(r))):
        assert np.array_equal(got.numpy(), np.full(4, float(mine.ranks[-1]))), got
    for got in both(lambda t: hvd.allgather(t, process_set=mine), tf.fill([k + 1, 2], r)):
        want = np.concatenate([np.full((q + 1, 2), p) for q, p in enumerate(mine.ranks)])
        assert np.array_equal(got.numpy(), want), got
    for got in both(lambda t: hvd.alltoall(t, process_set=mine), tf.fill([m], float(r))):
        assert got.numpy().tolist() == [float(p) for p in mine.ranks], got
    for got in both(lambda t: hvd.reducescatter(t, op=hvd.Sum, process_set=mine),
                    tf.ones([m + 1, 2])):
        assert np.array_equal(got.numpy(), np.full((2 if k == 0 else 1, 2), float(m))), got
    v = tf.Variable(tf.fill([2], float(r)))
    hvd.broadcast_variables([v], root_rank=mine.ranks[0], process_set=mine)
    assert v.numpy().tolist() == [float(mine.ranks[0])] * 2, v
    assert hvd.allgather_object(r, process_set=mine) == mine.ranks
    hvd.barrier(process_set=mine)
    if other is not None:
        expect_error(lambda: hvd.allreduce(tf.ones(1), process_set=other), RuntimeError,
                     "process set")
    hvd.remove_process_set(even)
    expect_error(lambda: hvd.allreduce(tf.ones(1), process_set=even), ValueError,
                 "not an added process set")
    if odd is not None:
        hvd.remove_process_set(odd)
    return 1


def check_errors(r, n):
    bad = [(lambda: hvd.allreduce(tf.constant([True, False])), TypeError, "bool"),
           (lambda: hvd.allreduce(tf.constant([1 + 2j])), TypeError, "complex128"),
           (lambda: hvd.allreduce(tf.constant(["a"])), TypeError, "string"),
           (lambda: hvd.allgather(tf.constant(["a"])), TypeError, "string"),
           (lambda: hvd.allreduce(tf.ones(2, tf.int32), op=hvd.Adasum), TypeError,
            "floating-point"),
           (lambda: hvd.allreduce(tf.ones(2, tf.int32), prescale_factor=2.0), TypeError,
            "floating-point"),
           (lambda: hvd.reducescatter(tf.ones(2), op=hvd.Adasum), ValueError,
            "Adasum is an allreduce only"),
           (lambda: hvd.reducescatter(tf.constant(1.0)), ValueError, "0-dimensional"),
           (lambda: hvd.allreduce(tf.ones(2), op="max"), ValueError, "unknown reduction"),
           (lambda: hvd.alltoall(tf.ones(3), splits=[5] * n), ValueError, "splits")]
    for call, kind, word in bad:
        expect_error(call, kind, word)
        expect_error(tf.function(call), kind, word)
    # A length that differs between ranks fails on every rank, naming it, eagerly and in a
    # tf.function; the next collective works.
    if n > 1:
        for mode in ("eager", "graph"):
            fn = (lambda t: hvd.allreduce(t)) if mode == "eager" else \
                tf.function(lambda t: hvd.allreduce(t))
            e = expect_error(lambda: fn(tf.ones(3 + r)), (RuntimeError, tf.errors.OpError))
            assert "length" in str(e) or "mismatch" in str(e), (mode, str(e))
            got = hvd.allreduce(tf.ones(2), op=hvd.Sum)
            assert got.numpy().tolist() == [n] * 2, (mode, got)
        # Rows of other lengths, and another dtype: named on every rank.
        for call, words in ((lambda: hvd.allgather(tf.ones([1, 2 + r])), "rows of"),
                            (lambda: hvd.allreduce(tf.ones(2, tf.float32 if r == 0 else
                                                            tf.float64)), "f64")):
            expect_error(call, RuntimeError, "mismatch", words)
            assert hvd.allreduce(tf.ones(1), op=hvd.Sum).numpy().tolist() == [n]
    # Inside a tf.function TensorFlow wraps a collective's failure; hvd.elastic gets it back.
    def failing(*_):
        raise hvd.HorovodInternalError("peer 1 lost")

    try:
        tf.function(lambda: buffers.run(failing, [], [tf.int32], [[]], "Failing"))()
    except tf.errors.OpError as e:
        back = elastic._translated(e)
        assert isinstance(back, hvd.HorovodInternalError) and "peer 1 lost" in str(back), back
    else:
        raise AssertionError("the failing node ran")
    assert elastic._translated(tf.errors.UnknownError(None, None, "other")) is None
    # TF1's session-bound APIs name the TF2 way.
    expect_error(lambda: hvd.BroadcastGlobalVariablesHook(0), RuntimeError,
                 "broadcast_variables", "BroadcastGlobalVariablesCallback")
    expect_error(lambda: hvd.broadcast_global_variables(0), RuntimeError,
                 "broadcast_variables")
    return len(bad) + 3


def check_graph_nodes(r, n):
    """The allreduces of a traced function are the nodes this run expects."""
    expect = os.environ.get("HVD_TEST_GRAPH_OPS", "compiled")
    f = tf.function(lambda a, b: [hvd.allreduce(a), hvd.grouped_allreduce([a, b])])
    graph = f.get_concrete_function(tf.ones([2]), tf.ones([3], tf.float64)).graph
    types = [op.type for op in graph.get_operations()]
    compiled = types.count("HvdGroupedAllreduce")
    numpy = types.count("PyFunc") + types.count("EagerPyFunc")
    if expect == "compiled":
        assert graph_ops.library() is not None, "the compiled op did not load"
        assert compiled == 2 and numpy == 0, types
    else:
        assert graph_ops.library() is None, "the compiled op loaded where it should not"
        assert compiled == 0 and numpy == 2, types
    # A process set's allreduce stays a numpy_function node.
    if n > 1:
        ps = hvd.add_process_set(list(range(n)))
        g = tf.function(lambda a: hvd.allreduce(a, process_set=ps))
        types = [op.type for op in g.get_concrete_function(tf.ones([2])).graph.get_operations()]
        assert "HvdGroupedAllreduce" not in types, types
        assert g(tf.ones([2])).numpy().tolist() == [1.0, 1.0]
        hvd.remove_process_set(ps)
    outs = f(tf.fill([2], float(r)), tf.fill([3], 2.0 * r))
    want = (n - 1) / 2
    assert np.allclose(outs[0].numpy(), want) and np.allclose(outs[1][1].numpy(), 2 * want)
    return 2


def check_join_and_topology(r, n):
    # join: rank p runs p + 1 steps, then joins; a joined rank counts as zeros in the others'
    # allreduces, and every rank learns the rank that joined last.
    for step in range(r + 1):
        live = sum(1 for p in range(n) if p + 1 > step)
        got = hvd.allreduce(tf.ones(3, tf.float64), op=hvd.Sum)
        assert got.numpy().tolist() == [float(live)] * 3, (step, got)
    assert int(hvd.join()) == n - 1
    assert hvd.allreduce(tf.ones(1), op=hvd.Sum).numpy().tolist() == [n]
    ops = tf.function(lambda: [hvd.size_op(), hvd.rank_op(), hvd.local_rank_op(),
                               hvd.local_size_op()])()
    assert [int(o) for o in ops] == [n, r, hvd.local_rank(), hvd.local_size()], ops
    assert hvd.gloo_built() and hvd.gloo_enabled() and not hvd.nccl_built()
    assert not (hvd.mpi_built() or hvd.mpi_enabled() or hvd.cuda_built() or hvd.rocm_built())
    return 2


def main():
    check_before_init()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert hvd.is_initialized() and 0 <= hvd.local_rank() < hvd.local_size() <= n
    cases = 0
    for check in (check_graph_nodes, check_allreduce, check_sparse_and_grouped, check_movers,
                  check_reducescatter, check_gradients, check_tape_and_optimizer,
                  check_variables, check_process_sets, check_errors,
                  check_join_and_topology):
        cases += check(r, n)
    hvd.barrier()
    print(f"tensorflow ok: rank {r} of {n}, {cases} cases", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
