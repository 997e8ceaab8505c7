"""Horovod's ``horovod.keras.elastic`` for Keras 3: ``hvd.tensorflow.keras.elastic``'s
``KerasState`` and elastic callbacks bound to Keras 3 (the same classes where ``tf.keras`` is
Keras 3)."""

from hvd.tensorflow.keras.elastic import *  # noqa: F401,F403
from hvd.tensorflow.keras.elastic import __all__  # noqa: F401
from hvd.tensorflow.keras.elastic import elastic_for as _elastic_for
from hvd.tensorflow.keras.flavour import KERAS3 as _KERAS3

_K3 = _elastic_for(_KERAS3)
KerasState = _K3["KerasState"]
CommitStateCallback = _K3["CommitStateCallback"]
UpdateBatchStateCallback = _K3["UpdateBatchStateCallback"]
UpdateEpochStateCallback = _K3["UpdateEpochStateCallback"]
