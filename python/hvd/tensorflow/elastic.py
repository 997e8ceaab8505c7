"""Elastic training with TensorFlow 2, as Horovod's ``horovod.tensorflow.elastic``:
``TensorFlowKerasState`` (a Keras 3 model and optimizer in a custom training loop) and
``TensorFlowState`` (a list of variables) on hvd's one elastic core (``hvd.elastic``:
``State``, ``ObjectState``, ``run``), which decides every sync in Rust. This module says only
how TensorFlow variables are saved, restored and broadcast.

A commit keeps each variable's value as a tensor: TensorFlow's tensors are values, so taking
one costs nothing until the variable is next written, which copies it then. A rollback assigns
each kept value back (one copy per variable). A sync sends every variable in one fused
broadcast, after checking that every rank's variables have the root's shapes and dtypes, so
a model built differently on one rank is an error on every rank, never a hang.
"""

import tensorflow as tf

from hvd.common import arrays as _arrays
from hvd.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState,  # noqa: F401
                         State, run)
from hvd.tensorflow import ops as _ops


def _layout(variables):
    return [(tuple(v.shape), str(v.dtype)) for v in variables]


def _value(v):
    """A Keras 3 variable's or a ``tf.Variable``'s current value as a tensor."""
    return tf.convert_to_tensor(getattr(v, "value", v))


def check_keras3(obj, what):
    """Refuses a Keras 2 object (``tf_keras``, or TensorFlow's bundled Keras 2) with an error
    naming Keras 3, which hvd's Keras support is written for."""
    module = type(obj).__module__
    if module.startswith(("tf_keras", "keras.src.legacy", "tensorflow.python.keras",
                          "keras.api._v2")):
        raise TypeError(f"{what} is a Keras 2 object ({type(obj).__module__}."
                        f"{type(obj).__name__}): hvd.tensorflow.keras serves Keras 3 "
                        f"(`import keras`, keras>=3)")


class _VariablesState(ObjectState):
    """State of TensorFlow variables (``_variables()`` lists them) and plain attributes."""

    def __init__(self, **kwargs):
        self._kept = []
        super().__init__(**kwargs)

    def _variables(self):
        raise NotImplementedError

    def save(self):
        self._kept = [tf.identity(_value(v)) for v in self._variables()]
        super().save()

    def restore(self):
        variables = self._variables()
        if len(variables) != len(self._kept):
            raise ValueError(f"the state holds {len(variables)} variables, but its last "
                             f"commit kept {len(self._kept)}: variables were created after "
                             f"the commit")
        for v, kept in zip(variables, self._kept):
            v.assign(kept)
        super().restore()

    def _sync_from(self, root):
        variables = self._variables()
        mine = _layout(variables)
        theirs = _arrays.broadcast_object(mine, root)
        differs = _arrays.allgather_object(mine != theirs)
        if any(differs):
            bad = [r for r, d in enumerate(differs) if d]
            first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b),
                         min(len(mine), len(theirs)))
            raise ValueError(
                f"the elastic state's variables differ from rank {root}'s on rank(s) {bad}: "
                f"rank {root} has {len(theirs)} variables, this rank {len(mine)}; the first "
                f"difference is variable {first}. Build the model and its optimizer the same "
                f"way on every rank before creating the state")
        _ops.broadcast_variables(variables, root_rank=root)
        super()._sync_from(root)


class TensorFlowState(_VariablesState):
    """State of a list of variables and any other attributes (Horovod's
    ``TensorFlowState``); TensorFlow 2 has no sessions, so ``session`` is refused."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise ValueError("TensorFlowState(session=...) is TF1's: TensorFlow 2 has no "
                             "sessions. Pass the variables (model.variables) eagerly, or use "
                             "hvd.elastic.TensorFlowKerasState(model, optimizer)")
        self.variables = list(variables or [])
        super().__init__(**kwargs)

    def _variables(self):
        return self.variables


class TensorFlowKerasState(_VariablesState):
    """State of a built Keras 3 model and its optimizer (all their variables, the optimizer's
    slots and iteration count included) and any other attributes: Horovod's
    ``TensorFlowKerasState``. The optimizer is built for the model's variables if it was not
    yet, so a worker that joins late holds the same variables as the others."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        del backend  # Keras 3 has one backend per process; accepted for Horovod's signature
        if optimizer is None:
            optimizer = getattr(model, "optimizer", None)
        # Further models and optimizers among the attributes are kept the same way.
        held = {"model": model, "optimizer": optimizer}
        held.update({k: v for k, v in kwargs.items() if _is_model(v) or _is_optimizer(v)})
        self._models_ = [v for v in held.values() if _is_model(v)]
        self._optimizers_ = [v for v in held.values() if _is_optimizer(v)]
        for m in self._models_:
            check_keras3(m, "the model")
            if not m.built:
                raise ValueError("the model must be built before the elastic state is "
                                 "created: call it on a batch or model.build(input_shape) "
                                 "first")
        for o in self._optimizers_:
            check_keras3(o, "the optimizer")
        if optimizer is not None and not getattr(optimizer, "built", True):
            optimizer.build(model.trainable_variables)
        for k, v in held.items():
            setattr(self, k, v)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in held})

    def _variables(self):
        out = []
        for m in self._models_:
            out += list(m.variables)
        for o in self._optimizers_:
            out += list(o.variables)
        return out


def _is_model(v):
    return hasattr(v, "variables") and hasattr(v, "built") and hasattr(v, "layers")


def _is_optimizer(v):
    return hasattr(v, "apply_gradients") and hasattr(v, "variables")


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "run"]
