"""Horovod's ``horovod.keras`` for Keras 3: ``import hvd.keras as hvd``. The API of
``hvd.tensorflow.keras`` (Keras 3 runs on TensorFlow here), bound to Keras 3 (``import keras``)
whatever ``tf.keras`` is: where ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` Keras 2,
``hvd.tensorflow.keras`` serves that and this module still serves Keras 3. Where ``tf.keras`` is
Keras 3, the two modules hold the same objects."""

from hvd.tensorflow.keras import *  # noqa: F401,F403
from hvd.tensorflow.keras import __all__  # noqa: F401
from hvd.tensorflow.keras.flavour import KERAS3 as _KERAS3
from hvd.tensorflow.keras.optimizer import distributed_optimizer as _distributed_optimizer
from hvd.tensorflow.keras.saving import load_model_for as _load_model_for

DistributedOptimizer = _distributed_optimizer(_KERAS3)
load_model = _load_model_for(_KERAS3)

from hvd.keras import callbacks  # noqa: E402,F401
from hvd.keras import elastic  # noqa: E402,F401 (KerasState and the elastic callbacks)
