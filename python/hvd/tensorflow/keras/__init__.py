"""Horovod's Keras API (``horovod.tensorflow.keras``) on TensorFlow, for ``tf.keras`` as the
process has it: ``import hvd.tensorflow.keras as hvd``. That is Keras 3 by default, and Keras 2
(``tf_keras``) when the process runs with ``TF_USE_LEGACY_KERAS=1``, as scripts written for
Horovod need (``hvd.tensorflow.keras.flavour`` decides once, at import). ``hvd.keras`` is the
same API for Keras 3 only.

Everything ``hvd.tensorflow`` exports is here too (``init``, ``rank``, ``size``, the
collectives, ``Compression``, process sets), with the Keras pieces: ``DistributedOptimizer``,
``load_model``, ``broadcast_global_variables`` and ``callbacks``.

What differs from Horovod: objects of the other Keras are refused with an error saying which
module serves which; a Keras 3 model trained with ``DistributedOptimizer`` is compiled with
``jit_compile=False`` (hvd's collectives run outside XLA); ``broadcast_global_variables``
raises, because TensorFlow 2 keeps no global variables: ``BroadcastGlobalVariablesCallback`` or
``broadcast_variables(model.variables, root_rank)`` do its work.
"""

import hvd.tensorflow as _hvd_tf
from hvd.tensorflow import *  # noqa: F401,F403 (hvd.tensorflow's API, as its __all__ lists it)
from hvd.tensorflow import __all__ as _tf_all
from hvd.tensorflow import Average, Compression
from hvd.tensorflow.keras import callbacks
from hvd.tensorflow.keras import elastic  # KerasState and the elastic callbacks
from hvd.tensorflow.keras.flavour import TF_KERAS as _FLAVOUR
from hvd.tensorflow.keras.optimizer import distributed_optimizer
from hvd.tensorflow.keras.saving import load_model_for

DistributedOptimizer = distributed_optimizer(_FLAVOUR)
load_model = load_model_for(_FLAVOUR)


def broadcast_global_variables(root_rank):
    """Horovod's broadcast of every global variable, which TensorFlow 2's Keras does not keep
    (its variables belong to models and optimizers; Horovod's raised in eager mode too):
    raises an error naming what does the work."""
    raise RuntimeError(
        "hvd.keras.broadcast_global_variables: TensorFlow 2's Keras keeps no global "
        "variables. Add "
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


__all__ = sorted(set(_tf_all) | {"DistributedOptimizer", "allreduce", "broadcast_global_variables",
                                 "callbacks", "load_model", "reducescatter"})
