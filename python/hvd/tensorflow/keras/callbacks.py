"""Horovod's Keras callbacks: the first broadcast of the model and optimizer, metrics
averaged over the ranks, and the learning-rate schedule and warmup of "Accurate, Large
Minibatch SGD" (Goyal et al., 2017).

Each is written once, as a class that any Keras's ``Callback`` completes: ``bind`` makes the
subclass of a ``Flavour``'s ``keras.callbacks.Callback`` (Keras 2's ``model.fit`` takes only
its own callbacks). The names here are those of ``tf.keras``'s Keras; ``hvd.keras.callbacks``
has Keras 3's.
"""

import functools

import numpy as np
import tensorflow as tf

import hvd.tensorflow as _hvd_tf
from hvd.tensorflow.keras.flavour import TF_KERAS


class _Callback:
    """A callback that refuses, when it is attached, a model of another Keras than its
    flavour's (``_flavour``, set by ``bind``)."""

    _flavour = None

    def set_model(self, model):
        self._flavour.require_model(model, f"{self._flavour.module}.callbacks."
                                          f"{type(self).__name__}")
        super().set_model(model)


def bind(impl, flavour, name, *bases):
    """The class ``name``: ``impl`` completed by ``bases`` (default: ``flavour``'s
    ``Callback``), with ``flavour`` as its Keras."""
    bases = bases or (flavour.keras.callbacks.Callback,)
    return type(name, (impl,) + bases,
                {"__module__": impl.__module__, "__qualname__": name, "__doc__": impl.__doc__,
                 "_flavour": flavour})


class _BroadcastGlobalVariables(_Callback):
    """Copies the model's variables and its optimizer's from ``root_rank`` to every rank
    once, so that all ranks start from the same state (random initialisation or a checkpoint
    loaded on one rank).

    Horovod broadcasts at the end of the first batch, when a Keras 2 optimizer had created
    its variables. This broadcasts the model at ``on_train_begin`` as well, so that every
    rank takes its first step from the same weights wherever the model is built by then
    (Keras 3 builds it before training; a Keras 2 model given no input shape is built in its
    first step). An optimizer not built by then (Keras 2's build in their first step) is
    broadcast, with the model again, at the end of the first batch. ``device`` is accepted
    and unused (hvd broadcasts in host memory); ``local_variables`` are left as each rank
    has them.
    """

    def __init__(self, root_rank, device='', local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local = set()
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        for v in local_variables:
            self.register_local_var(v)

    def register_local_var(self, var):
        """Leaves ``var`` (a variable of the model) out of the broadcast: each rank keeps
        its own value."""
        if not isinstance(var, self._flavour.variable_types()):
            raise ValueError(f"local variables must be Keras or TensorFlow variables, not "
                             f"{type(var).__name__}")
        self._local.add(id(var))

    def _is_local(self, var):
        return id(var) in self._local or id(getattr(var, "value", None)) in self._local

    def _broadcast(self):
        """Broadcasts the model's variables, and the optimizer's once it has them."""
        # A Keras 2 model given no input shape has no variables (and says so by raising)
        # until its first step builds it.
        built = self.model.variables if self.model.built else []
        shared = [v for v in built if not self._is_local(v)]
        _hvd_tf.broadcast_variables(shared, root_rank=self.root_rank)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not self._flavour.optimizer_built(optimizer):
            return
        _hvd_tf.broadcast_variables(self._flavour.optimizer_variables(optimizer),
                                    root_rank=self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True


class _MetricAverage(_Callback):
    """Replaces every metric in the logs at the end of an epoch by its average over the
    ranks, for the callbacks after it (``ReduceLROnPlateau``, ``ModelCheckpoint``,
    TensorBoard, the returned history). Put it before them in the list.

    The metrics are averaged in one allreduce, in float64, in sorted name order (every rank
    must report the same names). ``device`` is accepted and unused.
    """

    def __init__(self, device=''):
        super().__init__()
        self.device = device

    def _average_metrics_in_place(self, logs):
        if not logs:
            return
        names = sorted(logs)
        values = []
        for name in names:
            try:
                values.append(float(np.asarray(logs[name])))
            except (TypeError, ValueError):
                raise TypeError(f"MetricAverageCallback averages numbers; the log "
                                f"{name!r} is {type(logs[name]).__name__}") from None
        averaged = _hvd_tf.allreduce(tf.constant(values, dtype=tf.float64),
                                     op=_hvd_tf.Average)
        for name, value in zip(names, np.asarray(averaged).tolist()):
            logs[name] = value

    def on_epoch_end(self, epoch, logs=None):
        self._average_metrics_in_place(logs)


class _LearningRateSchedule(_Callback):
    """Sets the optimizer's learning rate to ``initial_lr * multiplier(epoch)`` from
    ``start_epoch`` up to (not including) ``end_epoch``. ``multiplier`` is a function of the
    epoch or a number ``m``, meaning ``m ** (epoch - start_epoch)``. With ``staircase`` the rate
    changes at the first batch of each epoch, with the whole epoch number; without, at every
    batch, with ``epoch + batch / steps_per_epoch`` (``steps_per_epoch`` found from
    ``model.fit``'s parameters when not given). ``logs['lr']`` reports the rate at each
    epoch's end.

    With ``momentum_correction``, a change of the rate from ``old`` to ``new`` scales the
    momentum the next step carries by ``new / old``, as Horovod does. Horovod multiplies the
    optimizer's ``momentum`` for one batch; Keras 3 (and Keras 2's current optimizers) read
    that number when they trace the training step, so this scales the momentum buffers of
    SGD and RMSprop (Keras 2's legacy ones too) by ``new / old`` instead, which gives the
    same step (for Nesterov SGD the look-ahead term keeps the uncorrected momentum). Other
    optimizers get no correction.

    The learning rate is the optimizer's learning-rate variable; an optimizer built on a
    ``LearningRateSchedule`` is refused.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self):
        steps = (self.params or {}).get("steps")
        if steps:
            return steps
        raise ValueError(f"Could not autodetect the number of steps per epoch (model.fit "
                         f"did not know it). Please specify the steps_per_epoch parameter "
                         f"to the {type(self).__name__}()")

    def _lr(self):
        """The optimizer's learning-rate variable (refused for a schedule)."""
        try:
            return self._flavour.learning_rate(self.model.optimizer)
        except TypeError as e:
            raise TypeError(f"{type(self).__name__} sets the optimizer's learning rate, but "
                            f"{e}") from None

    def _adjust_learning_rate(self, epoch):
        lr = self._lr()
        old_lr = float(np.asarray(lr))
        new_lr = self.initial_lr * self.multiplier(epoch)
        lr.assign(new_lr)
        if self.momentum_correction and old_lr != 0 and new_lr != old_lr:
            for m in self._flavour.momentum_buffers(self.model.optimizer):
                m.assign(m * (new_lr / old_lr))

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.current_epoch < self.start_epoch
                or (self.end_epoch is not None and self.current_epoch >= self.end_epoch)):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(self._lr()))


class _LearningRateWarmup(_LearningRateSchedule):
    """Gradual warmup: the learning rate rises from ``initial_lr / hvd.size()`` to
    ``initial_lr`` over ``warmup_epochs``, batch by batch::

        epoch' = epoch + (batch + 1) / steps_per_epoch
        lr     = initial_lr / size * (epoch' * (size - 1) / warmup_epochs + 1)

    (the ``+ 1`` batch makes each epoch end on a round value, as in Horovod). With
    ``verbose``, rank 0 prints when the warmup is done.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            n = _hvd_tf.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _hvd_tf.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(np.asarray(self._lr())):g}.")


@functools.cache
def callbacks_for(flavour):
    """{name: class} of Horovod's four callbacks for ``flavour``'s Keras (one set per
    flavour, so ``hvd.keras`` and ``hvd.tensorflow.keras`` share them when both are
    Keras 3)."""
    schedule = bind(_LearningRateSchedule, flavour, "LearningRateScheduleCallback")
    return {
        "BroadcastGlobalVariablesCallback":
            bind(_BroadcastGlobalVariables, flavour, "BroadcastGlobalVariablesCallback"),
        "MetricAverageCallback": bind(_MetricAverage, flavour, "MetricAverageCallback"),
        "LearningRateScheduleCallback": schedule,
        "LearningRateWarmupCallback":
            bind(_LearningRateWarmup, flavour, "LearningRateWarmupCallback", schedule),
    }


_TF = callbacks_for(TF_KERAS)
BroadcastGlobalVariablesCallback = _TF["BroadcastGlobalVariablesCallback"]
MetricAverageCallback = _TF["MetricAverageCallback"]
LearningRateScheduleCallback = _TF["LearningRateScheduleCallback"]
LearningRateWarmupCallback = _TF["LearningRateWarmupCallback"]

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]
