"""Elastic training with TensorFlow 2, as Horovod's ``horovod.tensorflow.elastic``:
``TensorFlowKerasState`` (a ``tf.keras`` model and optimizer in a custom training loop: Keras 3,
or Keras 2 under ``TF_USE_LEGACY_KERAS=1``) and
``TensorFlowState`` (a list of variables) on hvd's one elastic core (``hvd.elastic``:
``State``, ``ObjectState``, ``run``), which decides every sync in Rust. This module says only
how TensorFlow variables are saved, restored and broadcast.

A commit keeps each variable's value as a tensor: TensorFlow's tensors are values, so taking
one costs nothing until the variable is next written, which copies it then. A rollback assigns
each kept value back; both run as one ``tf.function`` each, where TensorFlow hands the buffers
over instead of copying them. A sync sends every variable in one fused
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
    """A Keras 3 variable's or a ``tf.Variable``'s current value as a tensor (a Keras 3
    variable holds its ``tf.Variable`` as ``value``; a ``tf.Variable``'s is a method)."""
    inner = getattr(v, "value", None)
    return tf.convert_to_tensor(v if inner is None or callable(inner) else inner)


class _VariablesState(ObjectState):
    """State of TensorFlow variables (``_variables()`` lists them) and plain attributes."""

    def __init__(self, **kwargs):
        self._kept = 0
        self._programs = (None, None, None)
        super().__init__(**kwargs)

    def _variables(self):
        raise NotImplementedError

    def _compiled(self, variables):
        """Two ``tf.function``s without arguments over the variables and a shadow variable of
        each, which holds the commit: ``save`` assigns every variable to its shadow and
        ``restore`` every shadow back. In a graph an assignment hands the buffer over and
        the first later write copies it, where eager calls copy at once (a rollback of a
        ResNet-18's 94 MB costs about 1 ms instead of 30). Made again when the variables
        change; the third value says whether this call made them."""
        key = tuple(id(v) for v in variables)
        if self._programs[0] != key:
            shadows = [tf.Variable(_value(v), trainable=False) for v in variables]

            @tf.function(autograph=False)
            def save():
                for v, s in zip(variables, shadows):
                    s.assign(_value(v))

            @tf.function(autograph=False)
            def restore():
                for v, s in zip(variables, shadows):
                    v.assign(s.read_value())

            self._programs = (key, save, restore)
            made = True
        else:
            made = False
        return self._programs[1], self._programs[2], made

    def save(self):
        variables = self._variables()
        if variables:
            save, restore, made = self._compiled(variables)
            save()
            if made:
                # A function's first call instantiates and optimizes its graph (0.2 s for a
                # ResNet-18 and its optimizer): paid here, at the commit that made it, not
                # by the rollback while the job waits. Right after the save the rollback
                # hands every variable its own value back.
                restore()
        self._kept = len(variables)
        super().save()

    def restore(self):
        variables = self._variables()
        if len(variables) != self._kept:
            raise ValueError(f"the state holds {len(variables)} variables, but its last "
                             f"commit kept {self._kept}: variables were created after the "
                             f"commit")
        if variables:
            if self._programs[0] != tuple(id(v) for v in variables):
                raise ValueError("the state's variables were replaced since its last commit "
                                 "(a model or optimizer built again): commit before training "
                                 "on")
            _, restore, _ = self._compiled(variables)
            restore()
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
    """State of a built ``tf.keras`` model and its optimizer (all their variables, the
    optimizer's slots and iteration count included) and any other attributes: Horovod's
    ``TensorFlowKerasState``. The optimizer is built for the model's variables if it was not
    yet, so a worker that joins late holds the same variables as the others. A model or
    optimizer of another Keras than ``tf.keras``'s is refused (``hvd.keras.elastic.KerasState``
    takes Keras 3's where ``tf.keras`` is Keras 2)."""

    # The Keras this state takes (``hvd.tensorflow.keras.flavour``): tf.keras's unless a
    # subclass says otherwise.
    _flavour = None

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        del backend  # one Keras backend per process; accepted for Horovod's signature
        flavour = self._keras()
        if optimizer is None:
            optimizer = getattr(model, "optimizer", None)
        # Further models and optimizers among the attributes are kept the same way.
        held = {"model": model, "optimizer": optimizer}
        held.update({k: v for k, v in kwargs.items() if _is_model(v) or _is_optimizer(v)})
        self._models_ = [v for v in held.values() if _is_model(v)]
        self._optimizers_ = [v for v in held.values() if _is_optimizer(v)]
        what = type(self).__name__
        for m in self._models_:
            flavour.require_model(m, what)
            if not m.built:
                raise ValueError("the model must be built before the elastic state is "
                                 "created: call it on a batch or model.build(input_shape) "
                                 "first")
        for o in self._optimizers_:
            flavour.require_optimizer(o, what)
        if optimizer is not None:
            flavour.build_optimizer(optimizer, model.trainable_variables)
        for k, v in held.items():
            setattr(self, k, v)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in held})

    def _keras(self):
        if self._flavour is None:
            # Imported here: hvd.tensorflow loads this module before its Keras modules.
            from hvd.tensorflow.keras.flavour import TF_KERAS
            return TF_KERAS
        return self._flavour

    def _variables(self):
        flavour = self._keras()
        out = []
        for m in self._models_:
            out += list(m.variables)
        for o in self._optimizers_:
            out += flavour.optimizer_variables(o)
        return out


def _is_model(v):
    return hasattr(v, "variables") and hasattr(v, "built") and hasattr(v, "layers")


def _is_optimizer(v):
    return hasattr(v, "apply_gradients") and hasattr(v, "variables")


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "run"]
