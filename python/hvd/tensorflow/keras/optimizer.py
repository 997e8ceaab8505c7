"""``DistributedOptimizer`` for Keras on TensorFlow (Keras 3, or Keras 2 where ``tf.keras`` is
Keras 2): Horovod's wrapper that reduces the gradients across ranks before the update.

Every update of a Keras optimizer goes through one method: ``Optimizer.apply(grads,
variables)`` in Keras 3 (``model.fit``'s train step and ``apply_gradients`` both call it),
``apply_gradients(grads_and_vars)`` in Keras 2 (``model.fit`` calls ``minimize``, which calls
it). The wrapper overrides that method (``flavour.apply_method`` names it) and nothing else:
the gradients go to the engine as one fused grouped allreduce (one per group with
``groups``), then the wrapped class updates the variables with the result. Inside
``tf.function`` the reduction is a graph node (hvd's compiled op, see
``hvd.tensorflow.graph_ops``), so ``model.fit`` works unchanged; XLA cannot compile such a
node, so a Keras 3 model must be compiled with ``jit_compile=False``.

The wrapped optimizer is an instance of a subclass of the optimizer's class, named and
placed as it is, built from its config (its state starts empty, as in Horovod): ``isinstance``
holds, and a saved model records the original class, so it loads without hvd.
"""

import functools

import tensorflow as tf

import hvd.tensorflow as _hvd_tf
from hvd.tensorflow.gradient_tape import (check_grouping, communicates, make_reducer,
                                          reduce_sharing)

try:
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext as _in_xla
except ImportError:  # pragma: no cover (a TensorFlow without the helper)
    def _in_xla(graph):
        return False


class _Settings:
    """What a ``DistributedOptimizer`` was asked for, checked, and the reducer it makes;
    shared by every optimizer of one wrapped class (``load_model`` builds its optimizers
    from it)."""

    def __init__(self, compression, sparse_as_dense, gradient_predivide_factor, op,
                 backward_passes_per_step, average_aggregated_gradients, num_groups, groups,
                 process_set, scale_local_gradients=True):
        if op not in (_hvd_tf.Average, _hvd_tf.Sum, _hvd_tf.Adasum):
            raise ValueError(f"DistributedOptimizer reduces gradients with hvd.Average, "
                             f"hvd.Sum or hvd.Adasum, not {op!r}")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer of at least 1, "
                             f"not {backward_passes_per_step!r}")
        groups = check_grouping(op, gradient_predivide_factor, num_groups, groups)
        self.op = op
        self.passes = backward_passes_per_step
        self.average_aggregated = average_aggregated_gradients
        self.process_set = process_set
        self.scale_local = scale_local_gradients
        self.reduce = make_reducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                                   groups, process_set)


class _Accumulated:
    """The locally summed gradients of ``backward_passes_per_step`` and the count of passes
    since the last reduction. A plain object, so neither Keras nor TensorFlow tracks these
    variables as the optimizer's: they are not saved, broadcast or counted among its
    variables, and a saved model loads into the unwrapped class."""

    def __init__(self):
        self.count = None
        self.sums = {}
        # The variables registered as this rank's own, by identity: kept here, untracked, for
        # the same reason (Keras would otherwise take them for the optimizer's own).
        self.local = {}


class _Distributed:
    """What a wrapped optimizer class adds to the user's class (it comes first in the MRO):
    the reduction, written once. ``_Keras3Entry`` and ``_Keras2Entry`` route each Keras's
    update method through ``_hvd_update``; ``apply`` is the wrapped class's update, given the
    gradients and variables."""

    _hvd_settings = None
    _hvd_flavour = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hvd_acc = _Accumulated()

    def register_local_var(self, var):
        """Marks ``var`` as this rank's own: its gradient is not reduced across the ranks
        (only divided by them with ``scale_local_gradients``), as in Horovod."""
        self._hvd_acc.local[id(var)] = var

    def _hvd_update(self, grads, variables, apply):
        """Reduces ``grads`` across the ranks (every ``backward_passes_per_step``-th call;
        summed locally between), then updates ``variables`` with ``apply``."""
        if self._hvd_settings.passes == 1:
            return self._hvd_step(grads, variables, apply)
        return self._hvd_accumulate(grads, variables, apply)

    def _hvd_step(self, grads, variables, apply):
        """One update with gradients that are this rank's: reduced first (Average, Sum), or
        applied locally with the ranks' changes combined after (Adasum)."""
        if not communicates(self._hvd_settings.process_set):
            return apply(grads, variables)
        if self._hvd_settings.op is _hvd_tf.Adasum:
            return self._hvd_adasum_step(grads, variables, apply)
        settings = self._hvd_settings
        reduced = reduce_sharing(lambda g, v: _reduce(settings, g, v), grads, variables,
                                 self._hvd_acc.local, settings.scale_local,
                                 settings.process_set)
        return apply(reduced, variables)

    def _hvd_adasum_step(self, grads, variables, apply):
        """Horovod's delta form of Adasum: each rank takes the wrapped optimizer's step on
        its own gradients; the changes that step made to the variables are combined by Adasum,
        and every variable becomes its value before the step plus the combination."""
        stepped = [v for v, g in zip(variables, grads) if g is not None]
        starts = [tf.identity(_value(v)) for v in stepped]
        with tf.control_dependencies(starts):
            apply(grads, variables)
        deltas = [_value(v) - s for v, s in zip(stepped, starts)]
        settings = self._hvd_settings
        # A local variable keeps its own step.
        combined = reduce_sharing(lambda g, v: _reduce(settings, g, v), deltas, stepped,
                                  self._hvd_acc.local, False, settings.process_set)
        for v, s, d in zip(stepped, starts, combined):
            v.assign(s + tf.cast(d, s.dtype))

    def _hvd_accumulate(self, grads, variables, apply):
        """Adds ``grads`` to the local sums; every ``backward_passes_per_step``-th call
        reduces and applies the sums (divided by the count with
        ``average_aggregated_gradients``) and clears them. The calls between update no
        variable but count in ``iterations``, as Horovod's do."""
        acc = self._hvd_acc
        _make_sums(acc, grads, variables)
        with tf.init_scope():
            # Slots and the iteration count exist before the tf.cond, whose branches must
            # not create variables.
            self._hvd_flavour.build_optimizer(self, variables)
            iterations = self.iterations
        for g, v in zip(grads, variables):
            if g is not None:
                acc.sums[id(v)].assign_add(tf.cast(_dense(g), acc.sums[id(v)].dtype))
        acc.count.assign_add(1)
        passes = self._hvd_settings.passes

        def reduce_and_apply():
            scale = 1.0 / passes if self._hvd_settings.average_aggregated else 1.0
            summed = [None if g is None else acc.sums[id(v)] * scale
                      for g, v in zip(grads, variables)]
            self._hvd_step(summed, variables, apply)
            acc.count.assign(0)
            for s in acc.sums.values():
                s.assign(tf.zeros_like(s))

        def count_only():
            iterations.assign_add(1)

        if tf.executing_eagerly():
            if int(acc.count.numpy()) >= passes:
                reduce_and_apply()
            else:
                count_only()
        else:
            tf.cond(acc.count >= passes, reduce_and_apply, count_only)


class _Keras3Entry(_Distributed):
    """Keras 3: every update comes through ``apply(grads, trainable_variables)``."""

    def apply(self, grads, trainable_variables=None):
        """Reduces ``grads`` across the ranks, then updates ``trainable_variables`` as the
        wrapped class does. ``apply_gradients`` and ``model.fit`` come through here."""
        grads = list(grads)
        if not grads or (trainable_variables is None and not self.built):
            return super().apply(grads, trainable_variables)
        if trainable_variables is None:
            variables = list(self._trainable_variables)
        else:
            variables = list(trainable_variables)
            if not self.built:
                with self._hvd_flavour.keras.name_scope(self.name, caller=self):
                    self.build(variables)
                self.built = True
        return self._hvd_update(grads, variables, super().apply)


class _Keras2Entry(_Distributed):
    """Keras 2: every update comes through ``apply_gradients(grads_and_vars)``
    (``minimize``, and so ``model.fit``, calls it)."""

    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        """Reduces the gradients across the ranks, then applies them as the wrapped class
        does; returns the iteration count."""
        pairs = list(grads_and_vars)
        if not pairs:
            return super().apply_gradients(pairs, name=name, **kwargs)
        grads, variables = [list(p) for p in zip(*pairs)]
        wrapped = super().apply_gradients

        def apply(gs, vs):
            return wrapped(list(zip(gs, vs)), name=name, **kwargs)

        self._hvd_update(grads, variables, apply)
        return self.iterations


_ENTRIES = {"apply": _Keras3Entry, "apply_gradients": _Keras2Entry}


def _value(variable):
    """A Keras variable's current value as a tensor."""
    return tf.convert_to_tensor(variable)


def _dense(grad):
    """``grad`` as a dense tensor (``IndexedSlices``, from embeddings, summed into one)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


def _make_sums(acc, grads, variables):
    """Creates the accumulation variables on first use, outside any ``tf.function`` (they
    live as long as the optimizer)."""
    with tf.init_scope():
        if acc.count is None:
            acc.count = tf.Variable(0, dtype=tf.int64, trainable=False)
        for g, v in zip(grads, variables):
            if g is not None and id(v) not in acc.sums:
                acc.sums[id(v)] = tf.Variable(tf.zeros(v.shape, dtype=v.dtype),
                                              trainable=False)


def _reduce(settings, grads, variables):
    """``grads`` (a list, ``None`` where a variable has none) reduced across the ranks as
    ``settings`` says (``hvd.tensorflow``'s reducer: a grouped allreduce per group); refused
    inside an XLA-compiled step, which cannot run hvd's collectives."""
    if not tf.executing_eagerly() and _in_xla(tf.compat.v1.get_default_graph()):
        raise ValueError(
            "hvd.keras.DistributedOptimizer cannot reduce gradients inside an XLA-compiled "
            "step: hvd's collectives run on the host, outside XLA. Compile the model with "
            "model.compile(..., jit_compile=False)")
    return settings.reduce(grads, variables)


def distributed_class(cls, settings, flavour):
    """A subclass of ``flavour``'s optimizer class ``cls`` whose instances reduce their
    gradients as ``settings`` says; named and placed as ``cls`` is, so that Keras saves its
    optimizers as ``cls``'s."""
    return type(cls.__name__, (_ENTRIES[flavour.apply_method], cls),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 "__doc__": cls.__doc__, "_hvd_settings": settings, "_hvd_flavour": flavour})


def wrap_loaded(optimizer, flavour, compression):
    """Makes ``optimizer`` (just loaded, with its state) a ``DistributedOptimizer`` in
    place, reducing with Horovod's defaults and ``compression``: its class becomes the
    wrapped subclass of its class, and every variable stays as it was loaded."""
    settings = _Settings(compression, False, 1.0, _hvd_tf.Average, 1, False, 0, None,
                         _hvd_tf.global_process_set)
    optimizer.__class__ = distributed_class(type(optimizer), settings, flavour)
    optimizer._hvd_acc = _Accumulated()
    return optimizer


@functools.cache
def distributed_optimizer(flavour):
    """Horovod's ``DistributedOptimizer`` for ``flavour``'s optimizers (one function per
    flavour, so ``hvd.keras`` and ``hvd.tensorflow.keras`` share it when both are Keras 3)."""

    def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                             compression=_hvd_tf.Compression.none, sparse_as_dense=False,
                             gradient_predivide_factor=1.0, op=_hvd_tf.Average,
                             backward_passes_per_step=1, average_aggregated_gradients=False,
                             num_groups=0, groups=None,
                             process_set=_hvd_tf.global_process_set,
                             scale_local_gradients=True):
        flavour.require_optimizer(optimizer, f"{flavour.module}.DistributedOptimizer")
        if isinstance(optimizer, _Distributed):
            raise ValueError("the optimizer is a DistributedOptimizer already")
        settings = _Settings(compression, sparse_as_dense, gradient_predivide_factor, op,
                             backward_passes_per_step, average_aggregated_gradients,
                             num_groups, groups, process_set, scale_local_gradients)
        cls = distributed_class(type(optimizer), settings, flavour)
        return cls.from_config(optimizer.get_config())

    DistributedOptimizer.__doc__ = f"""Wraps the {flavour.name} ``optimizer`` so that every
    update applies gradients reduced across the ranks (of ``process_set``): averaged by
    default (``op=hvd.Sum`` sums), compressed on the wire by ``compression``, as one fused
    grouped allreduce per update (``groups``, or the deprecated ``num_groups``, splits it).
    ``backward_passes_per_step=k`` sums k calls' gradients locally and reduces and applies
    every k-th (the sum divided by k with ``average_aggregated_gradients``).
    ``op=hvd.Adasum`` is Horovod's delta form: every rank steps on its own gradients and the
    variables' changes are combined by Adasum. Variables registered with
    ``register_local_var`` keep this rank's gradients (divided by the ranks with
    ``scale_local_gradients``, Horovod's default).

    Returns an instance of a subclass of ``optimizer``'s class, built from its config (its
    state starts empty, as in Horovod; ``load_model`` keeps a saved optimizer's state).
    Sparse gradients (``IndexedSlices``) are allgathered, as in Horovod, unless
    ``sparse_as_dense``. Differences from Horovod: ``name``, ``device_dense`` and
    ``device_sparse`` are accepted and unused (hvd reduces in host memory, and its engine
    names the reductions); ``model.fit`` must not compile the step with XLA
    (``jit_compile=False``); a custom loop's ``apply_gradients`` reduces too.
    """
    return DistributedOptimizer
