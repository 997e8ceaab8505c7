"""The Keras that ``hvd.keras`` serves: Keras 3 (``import keras``, which ``tf.keras`` is
from TensorFlow 2.16 on). Horovod's Keras modules served Keras 2, whose optimizers and models
(``tf_keras``, ``tf.compat.v1``, ``tensorflow.python.keras``) work differently; they are
refused here with an error that says so, rather than half working."""

import os

import keras

# Where Keras 2 and TensorFlow 1 classes live: ``tf_keras`` (Keras 2 as a package of its
# own) and TensorFlow's private copy of Keras 2 or its v1 training API.
_KERAS2_HOMES = ("tf_keras", "tensorflow.python.keras", "tensorflow.python.training",
                 "keras.optimizers.legacy", "keras.src.optimizers.legacy")


def _home(obj):
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _is_keras2(obj):
    home = type(obj).__module__ or ""
    return any(home == h or home.startswith(h + ".") for h in _KERAS2_HOMES)


def _how():
    """How to get Keras 3, for an error message."""
    hint = "Build it with Keras 3 (`import keras`; tf.keras is Keras 3 from TensorFlow 2.16)"
    if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes"):
        hint += "; TF_USE_LEGACY_KERAS is set, which makes tf.keras Keras 2: unset it"
    return hint


def require_optimizer(optimizer, what):
    """Raises ``TypeError`` naming Keras 3 unless ``optimizer`` is a Keras 3 optimizer
    (``keras.optimizers.Optimizer``); ``what`` names the caller in the message."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer
    if _is_keras2(optimizer):
        raise TypeError(
            f"{what} wraps Keras 3 optimizers (keras.optimizers.Optimizer, keras "
            f"{keras.__version__}); got {_home(optimizer)}, a Keras 2 / TensorFlow 1 "
            f"optimizer. {_how()}")
    raise TypeError(f"{what} wraps a Keras 3 optimizer (keras.optimizers.Optimizer); got "
                    f"{_home(optimizer)}")


def require_model(model, what):
    """Raises ``TypeError`` naming Keras 3 unless ``model`` is a Keras 3 model
    (``keras.Model``); ``what`` names the caller in the message."""
    if isinstance(model, keras.Model):
        return model
    kind = "a Keras 2 / TensorFlow 1 model" if _is_keras2(model) else "not a Keras 3 model"
    raise TypeError(f"{what} works with Keras 3 models (keras.Model, keras "
                    f"{keras.__version__}); got {_home(model)}, {kind}. {_how()}")
