"""Horovod's ``horovod.keras.callbacks`` for Keras 3: those of ``hvd.tensorflow.keras``."""

from hvd.tensorflow.keras.callbacks import (  # noqa: F401
    BroadcastGlobalVariablesCallback, LearningRateScheduleCallback, LearningRateWarmupCallback,
    MetricAverageCallback)
