"""Horovod's ``horovod.keras.elastic`` for Keras 3: the same ``KerasState`` and elastic
callbacks as ``hvd.tensorflow.keras.elastic``."""

from hvd.tensorflow.keras.elastic import *  # noqa: F401,F403
from hvd.tensorflow.keras.elastic import __all__  # noqa: F401
