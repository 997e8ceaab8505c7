"""Horovod's Keras API (``horovod.tensorflow.keras``, ``horovod.keras``) for Keras 3 on
TensorFlow: ``import hvd.tensorflow.keras as hvd`` or ``import hvd.keras as hvd``.

Everything ``hvd.tensorflow`` exports is here too (``init``, ``rank``, ``size``, the
collectives, ``Compression``, process sets), with the Keras pieces: ``DistributedOptimizer``,
``load_model``, ``broadcast_global_variables`` and ``callbacks``.

What differs from Horovod: Keras 3 only (Keras 2 / ``tf_keras`` objects are refused with an
error saying so); a model trained with ``DistributedOptimizer`` is compiled with
``jit_compile=False`` (hvd's collectives run outside XLA); ``broadcast_global_variables``
raises, because Keras 3 keeps no global variables: ``BroadcastGlobalVariablesCallback`` or
``broadcast_variables(model.variables, root_rank)`` do its work.
"""

import keras as _keras

import hvd.tensorflow as _hvd_tf
from hvd.tensorflow import *  # noqa: F401,F403 (hvd.tensorflow's API, as its __all__ lists it)
from hvd.tensorflow import __all__ as _tf_all
from hvd.tensorflow import Average, Compression
from hvd.tensorflow.keras import callbacks
from hvd.tensorflow.keras import elastic  # KerasState and the elastic callbacks
from hvd.tensorflow.keras import saving as _saving
from hvd.tensorflow.keras.optimizer import DistributedOptimizer


def broadcast_global_variables(root_rank):
    """Horovod's broadcast of every global variable, which Keras 3 does not keep (its
    variables belong to models and optimizers): raises an error naming what does the work."""
    raise RuntimeError(
        "hvd.keras.broadcast_global_variables: Keras 3 keeps no global variables. Add "
        f"hvd.callbacks.BroadcastGlobalVariablesCallback({root_rank}) to model.fit's "
        f"callbacks, or call hvd.broadcast_variables(model.variables, root_rank={root_rank}) "
        f"and hvd.broadcast_variables(model.optimizer.variables, root_rank={root_rank}) once "
        f"the optimizer is built")


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """Horovod's Keras ``allreduce``: the reduction of a tensor-compatible ``value`` (a
    number, array or tensor) across the ranks (default: the average), as a tensor."""
    return _hvd_tf.allreduce(value, average=average, name=name, op=op,
                             prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, compression=compression)


def reducescatter(value, name=None, op=Average):
    """Horovod's Keras ``reducescatter``: ``value`` reduced across the ranks, each rank
    keeping its slice of the first dimension, as a tensor."""
    return _hvd_tf.reducescatter(value, op=op, name=name)


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none):
    """Loads a saved Keras 3 model with its optimizer wrapped in ``DistributedOptimizer``
    (reducing with ``compression``), the saved optimizer state kept. Every optimizer of
    ``keras.optimizers`` is wrapped without being named; ``custom_optimizers`` (Keras 3
    optimizer classes) are wrapped too; ``custom_objects`` are passed to Keras."""
    for cls in custom_optimizers or []:
        if not (isinstance(cls, type) and issubclass(cls, _keras.optimizers.Optimizer)):
            raise TypeError(f"custom_optimizers must be Keras 3 optimizer classes "
                            f"(subclasses of keras.optimizers.Optimizer), not {cls!r}")
    return _saving.load_model(filepath, custom_optimizers, custom_objects, compression)


__all__ = sorted(set(_tf_all) | {"DistributedOptimizer", "allreduce", "broadcast_global_variables",
                                 "callbacks", "load_model", "reducescatter"})
