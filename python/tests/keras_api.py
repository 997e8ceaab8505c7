"""``hvd.keras`` (Keras 3 on TensorFlow) under ``horovodrun -np N``, every result checked
against a reference computed here, on one process, from every rank's data:

- ``DistributedOptimizer`` through ``model.fit``, a custom loop (eager and ``tf.function``),
  ``backward_passes_per_step`` (summed and averaged), ``op=hvd.Sum``,
  ``gradient_predivide_factor``, ``groups``, fp16 compression and ``op=hvd.Adasum``: every
  rank ends with the same weights, those of one process training on the union of the
  batches (Adasum: the ranks' SGD steps combined by Adasum);
- the callbacks: the broadcast makes differently initialised ranks equal (also when the
  optimizer builds late), metrics are the ranks' mean, and the learning rate (and the
  momentum it carries) follows Horovod's formulas batch by batch;
- ``load_model`` keeps the optimizer's state and wraps it; Keras 2 / TF1 objects, XLA and
  misuse are refused with errors that say why.

Prints ``keras ok: rank R of N`` and exits 0, or raises.
"""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd.keras as hvd_keras  # noqa: E402
import hvd.tensorflow.keras as hvd  # noqa: E402
from hvd.tensorflow.keras.optimizer import _Distributed  # noqa: E402

BATCH = 4
STEPS = 6
INPUTS, OUTPUTS = 6, 2
LOSS = keras.losses.MeanSquaredError()


def make_model(seed):
    """A small two-layer model whose initial weights depend on ``seed`` only."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((INPUTS,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(OUTPUTS)])


def union_data(n, steps=STEPS, seed=7):
    """Every rank's rows, step after step: step s holds ranks 0..n-1's BATCH rows each."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * n * BATCH, INPUTS)).astype(np.float32)
    y = rng.standard_normal((steps * n * BATCH, OUTPUTS)).astype(np.float32)
    return x, y


def rows_of(a, r, n):
    """Rank ``r``'s rows of the union ``a``, in step order."""
    return a.reshape(-1, n, BATCH, a.shape[-1])[:, r].reshape(-1, a.shape[-1])


def weights(model):
    return [np.array(w) for w in model.get_weights()]


def close(got, want, what, tol=2e-5):
    for g, w in zip(got, want):
        err = float(np.abs(g - w).max(initial=0.0))
        assert err <= tol, f"{what}: off by {err}"


def same_on_every_rank(arrays, what):
    """Every rank holds exactly rank 0's ``arrays``."""
    root = hvd.broadcast_object(arrays, root_rank=0)
    for a, b in zip(arrays, root):
        assert np.array_equal(a, b), f"{what}: rank {hvd.rank()} differs from rank 0"


def grads_at(model, x, y):
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def reference(init, x, y, opt, batch, passes=1, average=False, scale=1.0):
    """One process: from weights ``init``, applies with ``opt`` the sum of ``passes``
    consecutive batches' gradients (their mean with ``average``), times ``scale``."""
    model = make_model(0)
    model.set_weights(init)
    micro = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]
    for s in range(0, len(micro), passes):
        total = None
        for xb, yb in micro[s:s + passes]:
            g = grads_at(model, xb, yb)
            total = g if total is None else [a + b for a, b in zip(total, g)]
        k = (1.0 / passes if average else 1.0) * scale
        opt.apply_gradients(zip([t * k for t in total], model.trainable_variables))
    return weights(model)


def sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def check_fit(r, n):
    """model.fit with different initial weights per rank and the broadcast callback: the
    same weights everywhere, equal to one process's fit on the union of the batches."""
    x, y = union_data(n)
    init = weights(make_model(100))  # rank 0's start, which the callback broadcasts
    model = make_model(100 + r)
    model.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss=LOSS, jit_compile=False)
    model.fit(rows_of(x, r, n), rows_of(y, r, n), batch_size=BATCH, epochs=2, shuffle=False,
              verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_every_rank(weights(model), "fit")
    want = reference(init, np.concatenate([x, x]), np.concatenate([y, y]), sgd(), n * BATCH)
    close(weights(model), want, "fit against the union")
    assert int(model.optimizer.iterations.numpy()) == 2 * STEPS


def train_loop(r, n, opt, graph, passes=1, calls=None):
    """A custom loop: tape.gradient then opt.apply_gradients, one call per micro-batch."""
    x, y = union_data(n, steps=STEPS * passes)
    model = make_model(0)
    xr, yr = rows_of(x, r, n), rows_of(y, r, n)

    def step(xb, yb):
        opt.apply_gradients(zip(grads_at(model, xb, yb), model.trainable_variables))

    step = tf.function(step) if graph else step
    for i in range(0, len(xr), BATCH):
        step(tf.constant(xr[i:i + BATCH]), tf.constant(yr[i:i + BATCH]))
    if calls is not None:
        assert int(opt.iterations.numpy()) == calls, (int(opt.iterations.numpy()), calls)
    return weights(model), x, y


def check_custom_loops(r, n):
    init = weights(make_model(0))
    for graph in (False, True):
        mode = "tf.function" if graph else "eager"
        got, x, y = train_loop(r, n, hvd.DistributedOptimizer(sgd()), graph, calls=STEPS)
        same_on_every_rank(got, f"custom loop ({mode})")
        close(got, reference(init, x, y, sgd(), n * BATCH), f"custom loop ({mode})")
        for average in (False, True):
            opt = hvd.DistributedOptimizer(sgd(), backward_passes_per_step=3,
                                           average_aggregated_gradients=average)
            got, x, y = train_loop(r, n, opt, graph, passes=3, calls=3 * STEPS)
            same_on_every_rank(got, f"backward_passes_per_step ({mode})")
            want = reference(init, x, y, sgd(), n * BATCH, passes=3, average=average)
            close(got, want, f"backward_passes_per_step=3, average={average} ({mode})")
    # Sum, a predivided average, explicit groups: the same numbers by other roads.
    got, x, y = train_loop(r, n, hvd.DistributedOptimizer(sgd(), op=hvd.Sum), True)
    close(got, reference(init, x, y, sgd(), n * BATCH, scale=n), "op=hvd.Sum")
    for kw in ({"gradient_predivide_factor": 2.0}, {"groups": 3}, {"num_groups": 2}):
        got, x, y = train_loop(r, n, hvd.DistributedOptimizer(sgd(), **kw), True)
        same_on_every_rank(got, str(kw))
        close(got, reference(init, x, y, sgd(), n * BATCH), str(kw))
    model = make_model(0)
    groups = [[model.trainable_variables[0], model.trainable_variables[3]]]
    opt = hvd.DistributedOptimizer(sgd(), groups=groups)
    x, y = union_data(n)
    xr, yr = rows_of(x, r, n), rows_of(y, r, n)
    for i in range(0, len(xr), BATCH):
        opt.apply_gradients(zip(grads_at(model, xr[i:i + BATCH], yr[i:i + BATCH]),
                                model.trainable_variables))
    close(weights(model), reference(init, x, y, sgd(), n * BATCH), "groups as lists")


def check_fit_accumulating(r, n):
    """backward_passes_per_step inside model.fit's compiled step (a tf.cond)."""
    x, y = union_data(n, steps=2 * STEPS)
    init = weights(make_model(0))
    model = make_model(0)
    opt = hvd.DistributedOptimizer(sgd(), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    model.fit(rows_of(x, r, n), rows_of(y, r, n), batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0)
    same_on_every_rank(weights(model), "fit with backward_passes_per_step")
    close(weights(model), reference(init, x, y, sgd(), n * BATCH, passes=2, average=True),
          "fit with backward_passes_per_step=2")


def check_sparse(r, n):
    """An embedding's gradient is IndexedSlices: allgathered, or reduced dense with
    sparse_as_dense; the same weights either way, those of the union's training."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 10, (STEPS * n * BATCH, 3)).astype(np.int32)
    y = rng.standard_normal((STEPS * n * BATCH, OUTPUTS)).astype(np.float32)

    def embedder():
        keras.utils.set_random_seed(5)
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4),
                                 keras.layers.Flatten(), keras.layers.Dense(OUTPUTS)])

    def train(model, opt, xs, ys, batch):
        @tf.function
        def step(xb, yb):
            g = grads_at(model, xb, yb)
            opt.apply_gradients(zip(g, model.trainable_variables))
            return isinstance(g[0], tf.IndexedSlices)

        sparse = [step(xs[i:i + batch], ys[i:i + batch]) for i in range(0, len(xs), batch)]
        return weights(model), all(sparse)

    want, sparse = train(embedder(), keras.optimizers.SGD(0.1), x, y, n * BATCH)
    assert sparse, "the embedding's gradient is not IndexedSlices"
    for dense in (False, True):
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=dense)
        got, _ = train(embedder(), opt, rows_of(x, r, n), rows_of(y, r, n), BATCH)
        same_on_every_rank(got, f"sparse_as_dense={dense}")
        close(got, want, f"embedding, sparse_as_dense={dense}")


def check_fp16(r, n):
    init = weights(make_model(0))
    opt = hvd.DistributedOptimizer(sgd(), compression=hvd.Compression.fp16)
    got, x, y = train_loop(r, n, opt, True)
    same_on_every_rank(got, "fp16")
    close(got, reference(init, x, y, sgd(), n * BATCH), "fp16 compression", tol=5e-3)


def adasum_pair(a, b):
    """Adasum of two vectors, in float64: each scaled down by half its projection on the
    other, then added."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    ab = float(np.vdot(a, b))
    wa = 1.0 - ab / (2.0 * float(np.vdot(a, a))) if np.any(a) else 1.0
    wb = 1.0 - ab / (2.0 * float(np.vdot(b, b))) if np.any(b) else 1.0
    return wa * a + wb * b


def adasum(parts):
    """The core's recursion over the ranks: the first half (rounded up), then the rest."""
    if len(parts) == 1:
        return parts[0].astype(np.float64)
    half = (len(parts) + 1) // 2
    return adasum_pair(adasum(parts[:half]), adasum(parts[half:]))


def check_adasum(r, n):
    """op=hvd.Adasum in Horovod's delta form: each rank's SGD step on its own batch, the
    steps combined by Adasum, per variable."""
    for graph in (False, True):
        adasum_run(r, n, graph)


def adasum_run(r, n, graph):
    lr = 0.05
    x, y = union_data(n)
    model = make_model(0)
    ref = make_model(0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), op=hvd.Adasum)

    def step(xb, yb):
        opt.apply_gradients(zip(grads_at(model, xb, yb), model.trainable_variables))

    step = tf.function(step) if graph else step
    for s in range(STEPS):
        rows = [slice((s * n + q) * BATCH, (s * n + q + 1) * BATCH) for q in range(n)]
        step(tf.constant(x[rows[r]]), tf.constant(y[rows[r]]))
        steps = [[-lr * np.array(g) for g in grads_at(ref, x[rw], y[rw])] for rw in rows]
        for k, v in enumerate(ref.trainable_variables):
            v.assign(v.numpy() + adasum([st[k] for st in steps]).astype(np.float32))
    same_on_every_rank(weights(model), "adasum")
    close(weights(model), weights(ref), "Adasum delta form", tol=1e-5)


class Probe(keras.callbacks.Callback):
    """Records the learning rate and momentum buffers at each batch's start, and the logs
    at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.lrs, self.momenta, self.logs = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(self.model.optimizer.learning_rate.numpy()))
        # The optimizer builds in the first step: no buffers before it.
        momenta = getattr(self.model.optimizer, "momentums", [])
        self.momenta.append([m.numpy() for m in momenta])

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


def fit_with(r, n, callbacks, epochs, lr=0.1, momentum=0.9):
    x, y = union_data(n)
    model = make_model(0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=momentum))
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    history = model.fit(rows_of(x, r, n), rows_of(y, r, n), batch_size=BATCH, epochs=epochs,
                        shuffle=False, verbose=0, callbacks=callbacks)
    return model, history


def check_warmup(r, n):
    """LearningRateWarmupCallback: lr = lr0 / n * ((e + (b + 1) / S) * (n - 1) / warmup + 1)
    at batch b of epoch e < warmup, then lr0; each change scales the momentum by new/old."""
    lr0, warmup, epochs = 0.1, 2, 3
    before, after = Probe(), Probe()
    cb = hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr0, warmup_epochs=warmup)
    fit_with(r, n, [before, cb, after], epochs, lr=lr0)
    want, last = [], lr0
    for e in range(epochs):
        for b in range(STEPS):
            if e < warmup:
                last = lr0 / n * ((e + (b + 1) / STEPS) * (n - 1) / warmup + 1)
            want.append(last)
    assert np.allclose(after.lrs, want, rtol=1e-6), (after.lrs, want)
    assert abs(want[warmup * STEPS - 1] - lr0) < 1e-12
    for i in range(1, len(want)):
        assert len(after.momenta[i]) == 4
        ratio = after.lrs[i] / before.lrs[i]
        for m0, m1 in zip(before.momenta[i], after.momenta[i]):
            assert np.allclose(m1, m0 * ratio, rtol=1e-5, atol=1e-9), f"momentum at batch {i}"
    assert np.allclose([l["lr"] for l in after.logs], [want[(e + 1) * STEPS - 1]
                                                       for e in range(epochs)], rtol=1e-6)


def check_schedule(r, n):
    """LearningRateScheduleCallback, staircase with a constant multiplier (lr0 * m ** (e -
    start) for start <= e < end) and smooth with a function of e + b / S."""
    lr0 = 0.2
    probe = Probe()
    cb = hvd.callbacks.LearningRateScheduleCallback(lr0, 0.5, start_epoch=1, end_epoch=3,
                                                    momentum_correction=False)
    fit_with(r, n, [cb, probe], 4, lr=0.05)
    want = [0.05] * STEPS + [lr0] * STEPS + [lr0 * 0.5] * STEPS + [lr0 * 0.5] * STEPS
    assert np.allclose(probe.lrs, want, rtol=1e-6), probe.lrs
    probe = Probe()
    cb = hvd.callbacks.LearningRateScheduleCallback(lr0, lambda e: 1.0 / (1.0 + e),
                                                    staircase=False)
    fit_with(r, n, [cb, probe], 2)
    want = [lr0 / (1.0 + e + b / STEPS) for e in range(2) for b in range(STEPS)]
    assert np.allclose(probe.lrs, want, rtol=1e-6), probe.lrs


def check_metric_average(r, n):
    """MetricAverageCallback: the logs after it (and the history) are the ranks' mean."""
    before, after = Probe(), Probe()
    _, history = fit_with(r, n, [before, hvd.callbacks.MetricAverageCallback(), after], 2)
    every = hvd.allgather_object(before.logs)
    for e, logs in enumerate(after.logs):
        mean = np.mean([every[q][e]["loss"] for q in range(n)])
        assert abs(logs["loss"] - mean) <= 1e-6 * abs(mean), (logs, mean)
        assert history.history["loss"][e] == logs["loss"]
    if n > 1:
        assert len({round(every[q][0]["loss"], 9) for q in range(n)}) > 1, "ranks' losses equal"
    same_on_every_rank([np.array(history.history["loss"])], "averaged losses")


def check_broadcast(r, n):
    """The callback copies rank 0's model (not a local variable) and, once it exists, its
    optimizer state; here the optimizer is built after training began."""
    model = make_model(100 + r)
    root = hvd.broadcast_object(weights(model), root_rank=0)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(optimizer=opt, loss=LOSS)
    local = model.layers[1].bias
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[local])
    cb.set_model(model)
    mine = local.numpy()
    cb.on_train_begin()
    assert not cb.broadcast_done and not opt.built
    for got, want, v in zip(weights(model), root, model.weights):
        if v is local:
            assert np.array_equal(got, mine), "a local variable was broadcast"
        else:
            assert np.array_equal(got, want), "model not broadcast"
    x = np.full((BATCH, INPUTS), r + 1.0, np.float32)
    opt.apply_gradients(zip(grads_at(model, x, x[:, :OUTPUTS]), model.trainable_variables))
    cb.on_train_batch_end(0)
    assert cb.broadcast_done
    same_on_every_rank([v.numpy() for v in opt.variables], "optimizer state")


def check_load_model(r, n):
    """load_model: the saved optimizer's class wrapped, its state kept; training on from
    the loaded model matches training on from the original. Plain Keras loads it as SGD."""
    x, y = union_data(n)
    xr, yr = rows_of(x, r, n), rows_of(y, r, n)
    model, _ = fit_with(r, n, [], 1)
    path = os.path.join(tempfile.mkdtemp(), f"model.{r}.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    opt = loaded.optimizer
    assert isinstance(opt, keras.optimizers.SGD) and isinstance(opt, _Distributed), type(opt)
    assert type(opt).__name__ == "SGD"
    for a, b in zip(model.optimizer.variables, opt.variables):
        assert np.array_equal(a.numpy(), b.numpy()), a.path
    for m in (model, loaded):
        m.fit(xr, yr, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    close(weights(loaded), weights(model), "training on after load_model", tol=1e-6)
    same_on_every_rank(weights(loaded), "loaded model")
    plain = keras.models.load_model(path)
    assert type(plain.optimizer) is keras.optimizers.SGD, type(plain.optimizer)
    assert keras.saving.serialize_keras_object(opt)["class_name"] == "SGD"
    with keras.saving.custom_object_scope({}):
        again = hvd.load_model(path, custom_optimizers=[keras.optimizers.SGD],
                               compression=hvd.Compression.fp16)
    assert isinstance(again.optimizer, _Distributed)


def raises(kind, needle, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except kind as e:
        assert needle in str(e), f"{needle!r} not in: {e}"
        return
    raise AssertionError(f"{fn.__name__} did not raise {kind.__name__} ({needle})")


def check_refusals(r, n):
    v1 = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    raises(TypeError, "Keras 3", hvd.DistributedOptimizer, v1)
    keras2 = type("SGD", (), {"__module__": "tf_keras.src.optimizers.sgd"})()
    raises(TypeError, "a Keras 2", hvd.DistributedOptimizer, keras2)
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    keras2_model = type("Sequential", (), {"__module__": "tf_keras.src.engine.sequential"})()
    raises(TypeError, "Keras 3 models", cb.set_model, keras2_model)
    raises(TypeError, "Keras 3", hvd.callbacks.MetricAverageCallback().set_model, keras2_model)
    raises(RuntimeError, "BroadcastGlobalVariablesCallback", hvd.broadcast_global_variables, 0)
    raises(ValueError, "already", hvd.DistributedOptimizer, hvd.DistributedOptimizer(sgd()))
    raises(ValueError, "hvd.Average, hvd.Sum or hvd.Adasum", hvd.DistributedOptimizer, sgd(),
           op=hvd.Max)
    raises(ValueError, "backward_passes_per_step", hvd.DistributedOptimizer, sgd(),
           backward_passes_per_step=0)
    raises(TypeError, "Keras 3 optimizer classes", hvd.load_model, "x.keras",
           custom_optimizers=[tf.compat.v1.train.GradientDescentOptimizer])
    raises(ValueError, "initial_lr", hvd.callbacks.LearningRateScheduleCallback, None, 0.5)
    if n > 1:  # one rank reduces nothing, so XLA compiles its step
        model = make_model(0)
        model.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss=LOSS, jit_compile=True)
        x = np.zeros((BATCH, INPUTS), np.float32)
        raises(Exception, "jit_compile=False", model.fit, x, x[:, :OUTPUTS], verbose=0)


def check_api():
    import hvd.keras.callbacks as keras_callbacks

    assert hvd_keras.DistributedOptimizer is hvd.DistributedOptimizer
    assert keras_callbacks.MetricAverageCallback is hvd.callbacks.MetricAverageCallback
    import hvd.tensorflow as hvd_tf
    missing = set(hvd_tf.__all__) - set(hvd.__all__) - set(hvd_keras.__all__)
    assert not missing and set(hvd.__all__) == set(hvd_keras.__all__), missing
    assert float(np.array(hvd.allreduce(2.0, op=hvd.Sum))) == 2.0 * hvd.size()
    assert isinstance(hvd.DistributedOptimizer(sgd()), keras.optimizers.SGD)


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    check_api()
    check_refusals(r, n)
    check_fit(r, n)
    check_custom_loops(r, n)
    check_fit_accumulating(r, n)
    check_sparse(r, n)
    check_fp16(r, n)
    check_adasum(r, n)
    check_broadcast(r, n)
    check_metric_average(r, n)
    check_warmup(r, n)
    check_schedule(r, n)
    check_load_model(r, n)
    print(f"keras ok: rank {r} of {n}", flush=True)


if __name__ == "__main__":
    main()
