"""``load_model``: a saved Keras model back, its optimizer a ``DistributedOptimizer``."""

import functools

from hvd.tensorflow.compression import Compression
from hvd.tensorflow.keras.optimizer import wrap_loaded


@functools.cache
def load_model_for(flavour):
    """Horovod's Keras ``load_model`` for ``flavour``'s models (one function per flavour)."""

    def load_model(filepath, custom_optimizers=None, custom_objects=None,
                   compression=Compression.none):
        objects = {}
        for cls in custom_optimizers or []:
            flavour.require_optimizer_class(cls, f"{flavour.module}.load_model's "
                                                    f"custom_optimizers")
            objects[cls.__name__] = cls
        objects.update(custom_objects or {})
        model = flavour.load_model(filepath, objects)
        if getattr(model, "optimizer", None) is not None:
            wrap_loaded(model.optimizer, flavour, compression)
        return model

    load_model.__doc__ = f"""Loads a saved {flavour.name} model (``.keras`` or ``.h5``; Keras 2
    also its SavedModel directories) with its optimizer made a ``DistributedOptimizer``
    (reducing with ``compression``) in place: the optimizer Keras loaded, saved state
    (iterations, slots) and all, becomes an instance of the wrapped subclass of its class.
    Any optimizer class Keras can load is wrapped, ``custom_optimizers`` ({flavour.name}
    optimizer classes) among them; ``custom_objects`` are passed to Keras."""
    return load_model
