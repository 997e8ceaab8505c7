"""Horovod's TensorFlow API (``horovod.tensorflow``) over hvd, for TensorFlow 2 eager code and
``tf.function``: ``import hvd.tensorflow as hvd``.

The collectives take eager CPU tensors' memory without a copy and hand their results back
as tensors over the arrays they were written into; ``hvd.tensorflow.buffers`` lists the
copies that remain. Inside ``tf.function`` they run as stateful graph nodes, in program
order, and a collective's failure reaches ``hvd.elastic.run`` as the
``HorovodInternalError`` or ``HostsUpdatedInterrupt`` it was, not TensorFlow's wrapping.

What differs from Horovod: there are no TF1 sessions. ``BroadcastGlobalVariablesHook`` and
``broadcast_global_variables`` raise an error naming ``broadcast_variables`` and Keras's
``hvd.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback``.
"""

from hvd import elastic as _elastic
from hvd.tensorflow import buffers as _buffers
from hvd.tensorflow.compression import Compression
from hvd.tensorflow.gradient_tape import DistributedGradientTape
from hvd.tensorflow.ops import *  # noqa: F401,F403 (the API, as ``ops.__all__`` lists it)
from hvd.tensorflow.ops import __all__ as _ops_all
from hvd.tensorflow.ops import _allreduce, _grouped_allreduce, _reducescatter  # noqa: F401
from hvd.tensorflow.optimizer import DistributedOptimizer

_elastic.register_error_translator(_buffers.translate)

from hvd.tensorflow import elastic  # noqa: E402 (hvd.elastic: TensorFlowKerasState, run)

_TF2_WAY = ("TensorFlow 2 has no sessions: call hvd.broadcast_variables(variables, root_rank=0) "
            "after the variables are created, or use "
            "hvd.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback(0) with Keras")


def broadcast_global_variables(root_rank):
    """Horovod's TF1 broadcast of the global variables collection, which TensorFlow 2 does
    not keep: raises an error naming the TF2 way."""
    raise RuntimeError(f"hvd.broadcast_global_variables is TF1's. {_TF2_WAY}")


class BroadcastGlobalVariablesHook:
    """Horovod's TF1 ``SessionRunHook``: raises an error naming the TF2 way."""

    def __init__(self, root_rank, device=''):
        raise RuntimeError(f"hvd.BroadcastGlobalVariablesHook is a TF1 session hook. "
                           f"{_TF2_WAY}")


__all__ = sorted(set(_ops_all) | {"BroadcastGlobalVariablesHook", "Compression",
                                  "DistributedGradientTape", "DistributedOptimizer",
                                  "broadcast_global_variables"})
