"""Horovod's ``horovod.keras.callbacks`` for Keras 3: ``hvd.tensorflow.keras``'s callbacks
bound to Keras 3 (the same classes where ``tf.keras`` is Keras 3)."""

from hvd.tensorflow.keras.callbacks import callbacks_for as _callbacks_for
from hvd.tensorflow.keras.flavour import KERAS3 as _KERAS3

_K3 = _callbacks_for(_KERAS3)
BroadcastGlobalVariablesCallback = _K3["BroadcastGlobalVariablesCallback"]
MetricAverageCallback = _K3["MetricAverageCallback"]
LearningRateScheduleCallback = _K3["LearningRateScheduleCallback"]
LearningRateWarmupCallback = _K3["LearningRateWarmupCallback"]

__all__ = sorted(_K3)
