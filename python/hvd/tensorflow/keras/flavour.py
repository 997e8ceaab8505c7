"""Which Keras hvd's Keras modules serve, and what differs between Keras 3 and Keras 2.

``hvd.tensorflow.keras`` serves ``tf.keras`` as the process has it, as Horovod's did: decided
once, when this module is imported, from the class ``tf.keras.Model`` really is (``TF_KERAS``).
That is Keras 3 (``keras``) by default, and Keras 2 (``tf_keras``) when the process runs with
``TF_USE_LEGACY_KERAS=1``, TensorFlow's own switch, which scripts written for Horovod need on a
current TensorFlow. ``hvd.keras`` serves Keras 3 only (``KERAS3``), as Horovod's served standalone
``keras``. An object of another Keras, or a TensorFlow 1 optimizer, is refused with a
``TypeError`` naming the switch and which module serves which, rather than half working.

Everything the rest of the Keras modules need to know about the difference is here: which
method the optimizer funnels its updates through, how its variables, learning rate and
momentum buffers are reached, how it is built, and how a model is loaded. The behaviour itself
(the reduction, the callbacks, the elastic state) is written once, against a ``Flavour``.
"""

import functools
import importlib

import tensorflow as tf

SWITCH = "TF_USE_LEGACY_KERAS"


def _home(obj):
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _kind(obj):
    """Which Keras (or TensorFlow 1) ``obj``'s class comes from, by its module; None when
    it is none of them."""
    cls = obj if isinstance(obj, type) else type(obj)
    home = cls.__module__ or ""

    def under(*prefixes):
        return any(home == p or home.startswith(p + ".") for p in prefixes)

    if under("tf_keras", "tensorflow.python.keras", "keras.api._v2", "keras.optimizers.legacy",
             "keras.src.optimizers.legacy"):
        return "Keras 2"
    if under("tensorflow.python.training"):
        return "TensorFlow 1"
    if under("keras"):
        return "Keras 3"
    return None


class Flavour:
    """One Keras, as hvd's Keras modules use it. ``KERAS3`` and ``KERAS2`` are the two."""

    name = ""
    package = ""
    # The hvd module that serves only this Keras, for messages.
    module = ""
    # The optimizer method every update goes through (``model.fit`` and custom loops).
    apply_method = ""

    @functools.cached_property
    def keras(self):
        """The Keras package itself, imported on first use."""
        return importlib.import_module(self.package)

    def describe(self):
        return f"{self.package} {self.keras.__version__}"

    def optimizer_classes(self):
        """The base classes of this Keras's optimizers."""
        raise NotImplementedError

    def variable_types(self):
        """The classes of this Keras's variables."""
        raise NotImplementedError

    # === checks ===

    def _advice(self, kind):
        """What to do instead, for an error about an object of ``kind``."""
        if kind == "TensorFlow 1":
            return ("tf.compat.v1.train optimizers take hvd.tensorflow.DistributedOptimizer "
                    "(or reduce with hvd.DistributedGradientTape)")
        if self is KERAS3 and TF_KERAS is KERAS2:
            return (f"tf.keras is Keras 2 (tf_keras) in this process, because {SWITCH}=1: "
                    f"hvd.tensorflow.keras serves it, and hvd.keras serves Keras 3 (`import "
                    f"keras`) only. Use hvd.tensorflow.keras for tf.keras objects, or unset "
                    f"{SWITCH}")
        if self is KERAS3:
            return (f"hvd.keras serves Keras 3, and so does hvd.tensorflow.keras unless the "
                    f"process runs with {SWITCH}=1, which makes tf.keras Keras 2 (tf_keras). "
                    f"Build it with Keras 3 (`import keras`, or tf.keras), or, for a script "
                    f"written for Keras 2, run it with {SWITCH}=1 (tf-keras installed) and "
                    f"import hvd.tensorflow.keras")
        return (f"tf.keras is Keras 2 (tf_keras) in this process, because {SWITCH}=1, and "
                f"hvd.tensorflow.keras serves it: build it with tf.keras. Keras 3 objects "
                f"(`import keras`) take hvd.keras, or run without {SWITCH} so that tf.keras "
                f"is Keras 3")

    def _refuse(self, obj, what, wants):
        kind = _kind(obj)
        got = f"a {kind} object" if kind else f"not a {self.name} object"
        raise TypeError(f"{what} takes {self.name} {wants} ({self.describe()}); got "
                        f"{_home(obj)}, {got}. {self._advice(kind)}")

    def require_optimizer(self, optimizer, what):
        """``optimizer``, or a ``TypeError`` unless it is this Keras's optimizer."""
        if isinstance(optimizer, self.optimizer_classes()):
            return optimizer
        self._refuse(optimizer, what, "optimizers")

    def require_optimizer_class(self, cls, what):
        """``cls``, or a ``TypeError`` unless it is a class of this Keras's optimizers."""
        if isinstance(cls, type) and issubclass(cls, self.optimizer_classes()):
            return cls
        self._refuse(cls, what, "optimizer classes")

    def require_model(self, model, what):
        """``model``, or a ``TypeError`` unless it is this Keras's model."""
        if isinstance(model, self.keras.Model):
            return model
        self._refuse(model, what, "models")

    # === optimizers ===

    def optimizer_variables(self, optimizer):
        """Every variable of ``optimizer`` (iterations, slots), as a list."""
        raise NotImplementedError

    def optimizer_built(self, optimizer):
        """Whether ``optimizer`` has created its slot variables."""
        raise NotImplementedError

    def build_optimizer(self, optimizer, variables):
        """Creates ``optimizer``'s slot variables for ``variables`` (a no-op once built)."""
        raise NotImplementedError

    def learning_rate(self, optimizer):
        """The variable holding ``optimizer``'s learning rate; a ``TypeError`` when a
        ``LearningRateSchedule`` computes it, which cannot be set."""
        lr = getattr(optimizer, "_learning_rate", None)
        if lr is None:  # Keras 2's legacy optimizers keep it among their hyperparameters
            lr = optimizer.learning_rate
        if isinstance(lr, self.keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError("this optimizer computes its learning rate from a "
                            "LearningRateSchedule, which cannot be set")
        return lr

    def momentum_buffers(self, optimizer):
        """The variables that carry the learning rate from step to step: the momentum
        buffers of SGD and RMSprop, which both update ``m = momentum * m ± lr * (...)``.
        Empty for other optimizers."""
        opts = self.keras.optimizers
        if isinstance(optimizer, opts.SGD):
            return list(getattr(optimizer, "momentums", []) or [])
        if isinstance(optimizer, opts.RMSprop):
            return list(getattr(optimizer, "_momentums", []) or [])
        return []

    # === saving ===

    def load_model(self, filepath, custom_objects):
        """This Keras's ``load_model``, with ``custom_objects`` also in scope (classes
        registered with Keras win over ``custom_objects``, not over a scope)."""
        with self.keras.saving.custom_object_scope(custom_objects):
            return self.keras.models.load_model(filepath, custom_objects=custom_objects)


class _Keras3(Flavour):
    name = "Keras 3"
    package = "keras"
    module = "hvd.keras"
    # Keras 3's model.fit and apply_gradients both call Optimizer.apply(grads, variables).
    apply_method = "apply"

    def optimizer_classes(self):
        return (self.keras.optimizers.Optimizer,)

    def variable_types(self):
        return (self.keras.Variable, tf.Variable)

    def optimizer_variables(self, optimizer):
        return list(optimizer.variables)

    def optimizer_built(self, optimizer):
        return bool(optimizer.built)

    def build_optimizer(self, optimizer, variables):
        if not optimizer.built:
            optimizer.build(variables)


class _Keras2(Flavour):
    name = "Keras 2"
    package = "tf_keras"
    module = "hvd.tensorflow.keras"
    # Keras 2's model.fit calls minimize, which computes the gradients and calls
    # apply_gradients(grads_and_vars); custom loops call apply_gradients.
    apply_method = "apply_gradients"

    def optimizer_classes(self):
        # The current optimizers and the legacy ones (tf.keras.optimizers.legacy).
        return (self.keras.optimizers.Optimizer, self.keras.optimizers.legacy.Optimizer)

    def variable_types(self):
        return (tf.Variable,)

    def optimizer_variables(self, optimizer):
        # A list that is also callable on the current optimizers, a method on the legacy.
        found = optimizer.variables
        return list(found() if callable(found) else found)

    def optimizer_built(self, optimizer):
        # The legacy optimizers create their slots one by one, and say nothing: not built.
        return bool(getattr(optimizer, "_built", False))

    def build_optimizer(self, optimizer, variables):
        if isinstance(optimizer, self.keras.optimizers.Optimizer):
            optimizer.build(variables)
        else:
            optimizer._create_all_weights(variables)

    def momentum_buffers(self, optimizer):
        legacy = self.keras.optimizers.legacy
        if isinstance(optimizer, (legacy.SGD, legacy.RMSprop)):
            slots = getattr(optimizer, "_slots", {})
            return [s["momentum"] for s in slots.values() if "momentum" in s]
        return super().momentum_buffers(optimizer)


KERAS3 = _Keras3()
KERAS2 = _Keras2()

# What tf.keras is in this process: its classes' package tells.
TF_KERAS = KERAS2 if tf.keras.Model.__module__.split(".")[0] == "tf_keras" else KERAS3

