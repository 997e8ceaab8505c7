"""``hvd.keras`` and ``hvd.tensorflow.keras`` under ``horovodrun -np N``, every result checked
against a reference computed here, on one process, from every rank's data. The script runs
on the Keras that ``tf.keras`` is: Keras 3 by default, Keras 2 (``tf_keras``) when run with
``TF_USE_LEGACY_KERAS=1``; the checks are the same but where the two differ (noted there).

- ``DistributedOptimizer`` through ``model.fit``, a custom loop (eager and ``tf.function``),
  ``backward_passes_per_step`` (summed and averaged), ``op=hvd.Sum``,
  ``gradient_predivide_factor``, ``groups``, fp16 compression and ``op=hvd.Adasum``: every
  rank ends with the same weights, those of one process training on the union of the
  batches (Adasum: the ranks' SGD steps combined by Adasum); on Keras 2 also a legacy
  optimizer (``tf.keras.optimizers.legacy``);
- the callbacks: the broadcast makes differently initialised ranks equal (also when the
  optimizer builds late), metrics are the ranks' mean, and the learning rate (and the
  momentum it carries) follows Horovod's formulas batch by batch;
- ``load_model`` keeps the optimizer's state and wraps it (``.keras`` on Keras 3, ``.h5`` on
  Keras 2; Keras 3's ``.h5`` loader drops the optimizer's slots); objects of the other
  Keras, TF1 optimizers, XLA and misuse are refused with errors that say why (and name
  ``TF_USE_LEGACY_KERAS``).

Prints ``keras ok: rank R of N`` and exits 0, or raises.
"""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd.keras as hvd_keras  # noqa: E402
import hvd.tensorflow.keras as hvd  # noqa: E402
from hvd.tensorflow.keras.optimizer import _Distributed  # noqa: E402

# The Keras hvd.tensorflow.keras serves: tf.keras as this process has it.
keras = tf.keras
KERAS2 = keras.Model.__module__.startswith("tf_keras")
KERAS_NAME = "Keras 2" if KERAS2 else "Keras 3"
# keras.saving, which tf.keras does not re-export on Keras 3.
saving = __import__("tf_keras" if KERAS2 else "keras").saving

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


def check_local_vars(r, n):
    """A variable registered with ``register_local_var`` steps by this rank's own gradient
    (divided by the ranks unless ``scale_local_gradients=False``), eagerly and inside
    ``tf.function``; the others by the average."""
    x, y = union_data(n)
    xr, yr = rows_of(x, r, n)[:BATCH], rows_of(y, r, n)[:BATCH]
    for scale in (True, False):
        for graph in (False, True):
            model = make_model(0)
            local = model.layers[1].bias
            before = weights(model)
            own = [np.array(g) for g in grads_at(model, xr, yr)]
            every = [[np.array(g) for g in grads_at(model, rows_of(x, p, n)[:BATCH],
                                                    rows_of(y, p, n)[:BATCH])]
                     for p in range(n)]
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                           scale_local_gradients=scale)
            opt.register_local_var(local)

            def step():
                opt.apply_gradients(zip(grads_at(model, xr, yr), model.trainable_variables))

            (tf.function(step) if graph else step)()
            at = [i for i, v in enumerate(model.trainable_variables) if v is local][0]
            for i, (w0, w1) in enumerate(zip(before, weights(model))):
                if i == at:
                    want = w0 - own[i] / (n if scale else 1)
                else:
                    want = w0 - np.mean([g[i] for g in every], 0)
                close([w1], [want], f"local variables (scale {scale}, graph {graph}), #{i}")


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
    # Keras 3 says "built"; Keras 2's optimizers "_built".
    assert not cb.broadcast_done and not getattr(opt, "built", getattr(opt, "_built", False))
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
    for suffix in ("h5",) if KERAS2 else ("keras",):
        load_model_from(r, n, suffix)


def load_model_from(r, n, suffix, opt_class=None):
    x, y = union_data(n)
    xr, yr = rows_of(x, r, n), rows_of(y, r, n)
    opt_class = opt_class or keras.optimizers.SGD
    model = make_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(opt_class(0.1, momentum=0.9)), loss=LOSS,
                  jit_compile=False)
    model.fit(xr, yr, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), f"model.{r}.{suffix}")
    model.save(path)
    loaded = hvd.load_model(path)
    opt = loaded.optimizer
    assert isinstance(opt, opt_class) and isinstance(opt, _Distributed), type(opt)
    assert type(opt).__name__ == "SGD"
    variables = [list(o.variables() if callable(o.variables) else o.variables)
                 for o in (model.optimizer, opt)]
    assert len(variables[0]) == len(variables[1]) > 1, variables
    for a, b in zip(*variables):
        assert np.array_equal(a.numpy(), b.numpy()), a.name
    for m in (model, loaded):
        m.fit(xr, yr, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    close(weights(loaded), weights(model), f"training on after load_model (.{suffix})",
          tol=1e-6)
    same_on_every_rank(weights(loaded), "loaded model")
    plain = keras.models.load_model(path)
    assert type(plain.optimizer) is opt_class, type(plain.optimizer)
    assert saving.serialize_keras_object(opt)["class_name"] == "SGD"
    with saving.custom_object_scope({}):
        again = hvd.load_model(path, custom_optimizers=[opt_class],
                               compression=hvd.Compression.fp16)
    assert isinstance(again.optimizer, _Distributed)


def check_legacy_optimizer(r, n):
    """Keras 2's legacy optimizers (tf.keras.optimizers.legacy) are wrapped too: a custom loop
    (plain and accumulating), model.fit with the broadcast and warmup callbacks, and
    load_model of an .h5 file."""
    legacy = keras.optimizers.legacy.SGD
    init = weights(make_model(0))
    for graph in (False, True):
        got, x, y = train_loop(r, n, hvd.DistributedOptimizer(legacy(0.05, momentum=0.9)),
                               graph, calls=STEPS)
        close(got, reference(init, x, y, sgd(), n * BATCH), f"legacy SGD (graph={graph})")
        opt = hvd.DistributedOptimizer(legacy(0.05, momentum=0.9), backward_passes_per_step=2,
                                       average_aggregated_gradients=True)
        got, x, y = train_loop(r, n, opt, graph, passes=2, calls=2 * STEPS)
        want = reference(init, x, y, sgd(), n * BATCH, passes=2, average=True)
        close(got, want, f"legacy SGD, backward_passes_per_step=2 (graph={graph})")
    x, y = union_data(n)
    model = make_model(100 + r)
    model.compile(optimizer=hvd.DistributedOptimizer(legacy(0.05, momentum=0.9)), loss=LOSS)
    probe = Probe()
    model.fit(rows_of(x, r, n), rows_of(y, r, n), batch_size=BATCH, epochs=2, shuffle=False,
              verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                    hvd.callbacks.LearningRateWarmupCallback(0.05, 1), probe])
    same_on_every_rank(weights(model), "legacy SGD through fit")
    want = [0.05 / n * ((b + 1) / STEPS * (n - 1) + 1) for b in range(STEPS)]
    assert np.allclose(probe.lrs[:STEPS], want, rtol=1e-6), (probe.lrs, want)
    load_model_from(r, n, "h5", legacy)


def raises(kind, needle, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except kind as e:
        assert needle in str(e), f"{needle!r} not in: {e}"
        return
    raise AssertionError(f"{fn.__name__} did not raise {kind.__name__} ({needle})")


def check_refusals(r, n):
    v1 = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    raises(TypeError, KERAS_NAME, hvd.DistributedOptimizer, v1)
    raises(TypeError, "TensorFlow 1", hvd.DistributedOptimizer, v1)
    check_other_keras_refused()
    raises(RuntimeError, "BroadcastGlobalVariablesCallback", hvd.broadcast_global_variables, 0)
    raises(ValueError, "already", hvd.DistributedOptimizer, hvd.DistributedOptimizer(sgd()))
    raises(ValueError, "hvd.Average, hvd.Sum or hvd.Adasum", hvd.DistributedOptimizer, sgd(),
           op=hvd.Max)
    raises(ValueError, "backward_passes_per_step", hvd.DistributedOptimizer, sgd(),
           backward_passes_per_step=0)
    raises(TypeError, f"{KERAS_NAME} optimizer classes", hvd.load_model, "x.keras",
           custom_optimizers=[tf.compat.v1.train.GradientDescentOptimizer])
    raises(ValueError, "initial_lr", hvd.callbacks.LearningRateScheduleCallback, None, 0.5)
    if n > 1:  # one rank reduces nothing, so XLA compiles its step
        model = make_model(0)
        model.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss=LOSS, jit_compile=True)
        x = np.zeros((BATCH, INPUTS), np.float32)
        raises(Exception, "jit_compile=False", model.fit, x, x[:, :OUTPUTS], verbose=0)


def check_other_keras_refused():
    """A real object of the other Keras (both are installed) is refused by the module that
    does not serve it, with an error naming the switch; so is a look-alike by its module."""
    import keras as keras3
    import tf_keras as keras2

    def model_of(k):
        return k.Sequential([k.Input((INPUTS,)), k.layers.Dense(OUTPUTS)])

    # (module, the Keras it refuses, that Keras's name)
    cases = [(hvd_keras, keras2, "a Keras 2")]
    if KERAS2:
        cases.append((hvd, keras3, "a Keras 3"))
    else:
        cases.append((hvd, keras2, "a Keras 2"))
    for module, other, kind in cases:
        for make in (lambda: other.optimizers.SGD(0.1), lambda: other.optimizers.Adam()):
            raises(TypeError, kind, module.DistributedOptimizer, make())
            raises(TypeError, "TF_USE_LEGACY_KERAS", module.DistributedOptimizer, make())
        model = model_of(other)
        for cb in (module.callbacks.BroadcastGlobalVariablesCallback(0),
                   module.callbacks.MetricAverageCallback()):
            raises(TypeError, "models", cb.set_model, model)
            raises(TypeError, "TF_USE_LEGACY_KERAS", cb.set_model, model)
        raises(TypeError, "TF_USE_LEGACY_KERAS", module.elastic.KerasState, model)
    if KERAS2:
        # hvd.keras serves Keras 3 even here: it wraps a Keras 3 optimizer.
        assert isinstance(hvd_keras.DistributedOptimizer(keras3.optimizers.SGD(0.1)), _Distributed)
        raises(TypeError, "hvd.tensorflow.keras serves it", hvd_keras.DistributedOptimizer,
               keras2.optimizers.SGD(0.1))
    else:
        raises(TypeError, "run it with TF_USE_LEGACY_KERAS=1", hvd.DistributedOptimizer,
               keras2.optimizers.SGD(0.1))
    home = "keras.src.optimizers.sgd" if KERAS2 else "tf_keras.src.optimizers.sgd"
    lookalike = type("SGD", (), {"__module__": home})()
    raises(TypeError, "a Keras 3" if KERAS2 else "a Keras 2", hvd.DistributedOptimizer,
           lookalike)


def check_api():
    import hvd.keras.callbacks as keras_callbacks

    import hvd.tensorflow as hvd_tf
    missing = set(hvd_tf.__all__) - set(hvd.__all__) - set(hvd_keras.__all__)
    assert not missing and set(hvd.__all__) == set(hvd_keras.__all__), missing
    assert float(np.array(hvd.allreduce(2.0, op=hvd.Sum))) == 2.0 * hvd.size()
    assert isinstance(hvd.DistributedOptimizer(sgd()), keras.optimizers.SGD)
    for cb in ("BroadcastGlobalVariablesCallback", "MetricAverageCallback",
               "LearningRateScheduleCallback", "LearningRateWarmupCallback"):
        assert issubclass(getattr(hvd.callbacks, cb), keras.callbacks.Callback), cb
    for cb in ("CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"):
        assert issubclass(getattr(hvd.elastic, cb), keras.callbacks.Callback), cb
    assert issubclass(hvd.callbacks.LearningRateWarmupCallback,
                      hvd.callbacks.LearningRateScheduleCallback)
    # hvd.keras is Keras 3's: the same objects where tf.keras is Keras 3, its own where not.
    same = not KERAS2
    assert (hvd_keras.DistributedOptimizer is hvd.DistributedOptimizer) == same
    assert (keras_callbacks.MetricAverageCallback is hvd.callbacks.MetricAverageCallback) == same
    assert (hvd_keras.elastic.KerasState is hvd.elastic.KerasState) == same
    assert (hvd_keras.load_model is hvd.load_model) == same


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    check_api()
    check_refusals(r, n)
    check_fit(r, n)
    check_custom_loops(r, n)
    check_local_vars(r, n)
    check_fit_accumulating(r, n)
    check_sparse(r, n)
    check_fp16(r, n)
    check_adasum(r, n)
    check_broadcast(r, n)
    check_metric_average(r, n)
    check_warmup(r, n)
    check_schedule(r, n)
    check_load_model(r, n)
    if KERAS2:
        check_legacy_optimizer(r, n)
    print(f"keras ok: rank {r} of {n}", flush=True)


if __name__ == "__main__":
    main()
