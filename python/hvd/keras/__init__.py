"""Horovod's ``horovod.keras`` for Keras 3: ``import hvd.keras as hvd``. The same API as
``hvd.tensorflow.keras`` (Keras 3 runs on TensorFlow here)."""

from hvd.tensorflow.keras import *  # noqa: F401,F403
from hvd.tensorflow.keras import __all__  # noqa: F401
from hvd.tensorflow.keras import callbacks  # noqa: F401
from hvd.keras import elastic  # noqa: F401 (KerasState and the elastic callbacks)
