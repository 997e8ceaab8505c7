"""``load_model``: a saved Keras 3 model back, its optimizer a ``DistributedOptimizer``."""

import keras

from hvd.tensorflow.keras.optimizer import _Distributed, wrapping_classes


def _optimizer_classes():
    """Every Keras 3 optimizer class defined so far (Keras's and the program's), except the
    wrapped classes ``DistributedOptimizer`` makes."""
    seen, todo = [], [keras.optimizers.Optimizer]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen and not issubclass(sub, _Distributed):
                seen.append(sub)
                todo.append(sub)
    return seen


def load_model(filepath, custom_optimizers, custom_objects, compression):
    """Loads the Keras 3 model saved at ``filepath`` (``.keras``, or a legacy ``.h5``) with
    its optimizer's class swapped for a ``DistributedOptimizer`` subclass of it, so the saved
    optimizer state (iterations, slots) is loaded into the wrapped optimizer. Every Keras
    optimizer class is wrapped (by class name and registered name), and so are
    ``custom_optimizers``; ``custom_objects`` are passed to Keras and win over them."""
    classes = _optimizer_classes() + [c for c in custom_optimizers or []]
    objects = wrapping_classes(classes, compression)
    objects.update(custom_objects or {})
    # A scope, not only custom_objects=: classes registered with
    # keras.saving.register_keras_serializable win over custom_objects, not over a scope.
    with keras.saving.custom_object_scope(objects):
        return keras.models.load_model(filepath, custom_objects=objects)
