"""``DistributedOptimizer`` for TensorFlow's legacy optimizers (``tf.compat.v1.train``), which
run eagerly in TensorFlow 2: their ``compute_gradients`` returns gradients reduced across
the ranks, as Horovod's. Keras optimizers take ``hvd.tensorflow.keras.DistributedOptimizer``.
"""

import tensorflow as tf

from hvd.common.basics import Adasum, Average, global_process_set
from hvd.tensorflow.compression import Compression
from hvd.tensorflow.gradient_tape import check_grouping, make_reducer, reduce_sharing

_Legacy = tf.compat.v1.train.Optimizer


class _DistributedOptimizer(_Legacy):
    """A legacy optimizer that reduces its gradients across the ranks before applying
    them; everything else is the wrapped optimizer's."""

    def __init__(self, optimizer, name, use_locking, reduce, process_set,
                 scale_local_gradients):
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._allreduce_grads = reduce
        self._process_set = process_set
        self._scale_local = scale_local_gradients
        # By identity; the values keep the variables alive.
        self._local_vars = {}

    def register_local_var(self, var):
        """Marks ``var`` as this rank's own: its gradient is not reduced (only divided by
        the ranks with ``scale_local_gradients``)."""
        self._local_vars[id(var)] = var

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, reduced across the ranks (but the local
        variables')."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        grads = reduce_sharing(self._allreduce_grads, grads, list(variables),
                               self._local_vars, self._scale_local, self._process_set)
        return list(zip(grads, variables))

    def apply_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``apply_gradients``."""
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        """The wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        """The wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        """The wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='',
                         device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True):
    """Wraps a legacy ``tf.compat.v1.train.Optimizer`` so that its gradients are reduced
    across the ranks (default: averaged) before they are applied, as Horovod's. A Keras
    optimizer is refused with the path that takes it,
    ``hvd.tensorflow.keras.DistributedOptimizer``. As in Horovod's eager mode,
    ``backward_passes_per_step`` > 1 is refused for legacy optimizers, and so is
    ``op=hvd.Adasum`` (Horovod's delta optimizer for it is TF1 graph code)."""
    if not isinstance(optimizer, _Legacy):
        raise ValueError(
            f"hvd.tensorflow.DistributedOptimizer wraps tf.compat.v1.train optimizers; "
            f"{type(optimizer).__name__} is a Keras optimizer: use "
            f"hvd.tensorflow.keras.DistributedOptimizer(optimizer), or reduce the gradients "
            f"with hvd.DistributedGradientTape")
    if backward_passes_per_step > 1:
        raise ValueError("backward_passes_per_step > 1 is not supported for a legacy "
                         "optimizer with eager execution (as in Horovod)")
    if op is Adasum:
        raise NotImplementedError("op=hvd.Adasum with a legacy optimizer is TF1 graph code: "
                                  "use hvd.DistributedGradientTape(tape, op=hvd.Adasum)")
    groups = check_grouping(op, gradient_predivide_factor, num_groups, groups)
    reduce = make_reducer(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                          process_set)
    return _DistributedOptimizer(optimizer, name or f"Distributed{type(optimizer).__name__}",
                                 use_locking, reduce, process_set, scale_local_gradients)
