"""Horovod's Keras callbacks for Keras 3: the first broadcast of the model and optimizer,
metrics averaged over the ranks, and the learning-rate schedule and warmup of "Accurate,
Large Minibatch SGD" (Goyal et al., 2017)."""

import keras
import numpy as np
import tensorflow as tf

import hvd.tensorflow as _hvd_tf
from hvd.tensorflow.keras.keras3 import require_model


class _Callback(keras.callbacks.Callback):
    """A callback that refuses, when it is attached, a model that is not a Keras 3 one."""

    def set_model(self, model):
        require_model(model, f"hvd.keras.callbacks.{type(self).__name__}")
        super().set_model(model)


class BroadcastGlobalVariablesCallback(_Callback):
    """Copies the model's variables and its optimizer's from ``root_rank`` to every rank
    once, so that all ranks start from the same state (random initialisation or a checkpoint
    loaded on one rank).

    Horovod broadcasts at the end of the first batch, when a Keras 2 optimizer had created
    its variables. Keras 3 builds the model and optimizer before training begins, so this
    broadcasts at ``on_train_begin`` and every rank takes its first step from the same
    state; an optimizer not built by then is broadcast (with the model again) at the end of
    the first batch, once it has created its variables. ``device`` is accepted and unused
    (hvd broadcasts in host memory); ``local_variables`` are left as each rank has them.
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
        if not isinstance(var, (keras.Variable, tf.Variable)):
            raise ValueError(f"local variables must be Keras or TensorFlow variables, not "
                             f"{type(var).__name__}")
        self._local.add(id(var))

    def _is_local(self, var):
        return id(var) in self._local or id(getattr(var, "value", None)) in self._local

    def _broadcast(self):
        """Broadcasts the model's variables, and the optimizer's once it has them."""
        shared = [v for v in self.model.variables if not self._is_local(v)]
        _hvd_tf.broadcast_variables(shared, root_rank=self.root_rank)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not optimizer.built:
            return
        _hvd_tf.broadcast_variables(list(optimizer.variables), root_rank=self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True


class MetricAverageCallback(_Callback):
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


def _lr_of(optimizer):
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _momentum_slots(optimizer):
    """The variables that carry the learning rate from step to step: the momentum buffers of
    SGD and RMSprop, which both update ``m = momentum * m ± lr * (...)``. Empty for other
    optimizers."""
    if isinstance(optimizer, keras.optimizers.SGD):
        return list(getattr(optimizer, "momentums", []) or [])
    if isinstance(optimizer, keras.optimizers.RMSprop):
        return list(getattr(optimizer, "_momentums", []) or [])
    return []


class LearningRateScheduleCallback(_Callback):
    """Sets the optimizer's learning rate to ``initial_lr * multiplier(epoch)`` from
    ``start_epoch`` up to (not including) ``end_epoch``. ``multiplier`` is a function of the
    epoch or a number ``m``, meaning ``m ** (epoch - start_epoch)``. With ``staircase`` the rate
    changes at the first batch of each epoch, with the whole epoch number; without, at every
    batch, with ``epoch + batch / steps_per_epoch`` (``steps_per_epoch`` found from
    ``model.fit``'s parameters when not given). ``logs['lr']`` reports the rate at each
    epoch's end.

    With ``momentum_correction``, a change of the rate from ``old`` to ``new`` scales the
    momentum the next step carries by ``new / old``, as Horovod does. Horovod multiplies the
    optimizer's ``momentum`` for one batch; Keras 3 reads that number when it traces the
    training step, so this scales the momentum buffers of SGD and RMSprop by ``new / old``
    instead, which gives the same step (for Nesterov SGD the look-ahead term keeps the
    uncorrected momentum). Other optimizers get no correction.

    The learning rate is the optimizer's variable ``optimizer.learning_rate``; an optimizer
    built on a ``LearningRateSchedule`` is refused.
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

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        if isinstance(optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError(f"{type(self).__name__} sets the optimizer's learning rate, but "
                            f"this optimizer computes it from a LearningRateSchedule")
        old_lr = _lr_of(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate.assign(new_lr)
        if self.momentum_correction and old_lr != 0 and new_lr != old_lr:
            for m in _momentum_slots(optimizer):
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
            logs["lr"] = _lr_of(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
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
                  f"{_lr_of(self.model.optimizer):g}.")
