"""Elastic training with Keras, as Horovod's ``horovod.tensorflow.keras.elastic`` and
``horovod.keras.elastic``: ``KerasState`` and the callbacks that keep it current while
``model.fit`` runs, on hvd's one elastic core (``hvd.elastic``).

```python
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
callbacks = [hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.UpdateEpochStateCallback(state)]

@hvd.elastic.run
def train(state):
    model.fit(data, steps_per_epoch=..., epochs=epochs - state.epoch, callbacks=callbacks)
```

A commit inside ``fit`` (a callback's) may raise ``HostsUpdatedInterrupt``, and a collective
of the optimizer may fail: either ends ``fit``, and ``run`` moves every rank to the next round
and calls ``train`` again from the state.

The state and callbacks here are ``tf.keras``'s Keras (Keras 2 under ``TF_USE_LEGACY_KERAS=1``);
``hvd.keras.elastic`` has Keras 3's. Each is written once and bound to a Keras by
``elastic_for``, as the callbacks of ``hvd.tensorflow.keras.callbacks`` are.
"""

import functools

from hvd.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState,  # noqa: F401
                         State, run)
from hvd.tensorflow.elastic import TensorFlowKerasState, TensorFlowState  # noqa: F401
from hvd.tensorflow.keras.callbacks import bind
from hvd.tensorflow.keras.flavour import TF_KERAS


class _KerasState:
    """State of a built Keras model, its optimizer (the model's compiled one unless
    ``optimizer`` is given) and any other attributes, such as ``batch`` and ``epoch``, which
    the callbacks below keep current."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        super().__init__(model, optimizer=optimizer, backend=backend, **kwargs)


class _CommitState:
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of every epoch:
    what a failure rolls back to. A commit due at an epoch's last batch is left to the
    epoch's end, which follows at once: the commit then holds the finished epoch as counted
    by ``UpdateEpochStateCallback`` (put this callback after it), so a rollback to it never
    runs the epoch again."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be at least 1, not {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        # Every rank starts counting afresh at each (re)start of fit.
        self.batches_remaining = self.batches_per_commit
        self.steps_per_epoch = self.params.get("steps") if self.params else None

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.batches_remaining = self.batches_per_commit
            if self.steps_per_epoch is None or batch + 1 < self.steps_per_epoch:
                self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class _UpdateBatchState:
    """Keeps ``state.batch`` at the batch of the epoch that ended last, and back at 0 when an
    epoch ends; the first epoch after a reset reports only its remaining steps
    (``params['steps']``), as in Horovod."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.params.get("steps") if self.params else None
        if steps:
            if self.steps_per_epoch is None:
                self.steps_per_epoch = steps
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class _UpdateEpochState:
    """Keeps ``state.epoch`` at the number of epochs finished: ``fit`` counts from 0 in each
    call, so the epoch the call started from is added."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


@functools.cache
def elastic_for(flavour):
    """{name: class} of ``KerasState`` and the three callbacks for ``flavour``'s Keras."""
    return {
        "KerasState": bind(_KerasState, flavour, "KerasState", TensorFlowKerasState),
        "CommitStateCallback": bind(_CommitState, flavour, "CommitStateCallback"),
        "UpdateBatchStateCallback": bind(_UpdateBatchState, flavour, "UpdateBatchStateCallback"),
        "UpdateEpochStateCallback": bind(_UpdateEpochState, flavour, "UpdateEpochStateCallback"),
    }


_TF = elastic_for(TF_KERAS)
KerasState = _TF["KerasState"]
CommitStateCallback = _TF["CommitStateCallback"]
UpdateBatchStateCallback = _TF["UpdateBatchStateCallback"]
UpdateEpochStateCallback = _TF["UpdateEpochStateCallback"]

__all__ = ["CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt",
           "KerasState", "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
