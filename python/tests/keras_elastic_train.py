"""An elastic Keras 3 job that proves no committed step is lost or applied twice, for the
tests and ``elastic_bench``: the ``elastic_counter`` events (JSON lines: start, reset, step,
commit, done) from a ``TensorFlowKerasState`` holding a model trained by hvd's Keras
``DistributedOptimizer`` and the counter, as ``elastic_train.py`` does for PyTorch.

Each step allreduces ones (the world's size) into ``total`` and appends the size to
``history``; the model's one weight gets gradient 1 on every rank, so SGD with learning rate
1 takes it to exactly ``-step``. At the end ``total`` equals the sum of ``history`` and the
weight equals ``-steps``.

``--fit`` trains through ``model.fit`` instead, with ``KerasState`` and Horovod's elastic
callbacks, an epoch of ``--commit-every`` steps, committed at its end.

The model is ``tf.keras``'s, the Keras ``hvd.tensorflow.keras`` serves: Keras 3, or Keras 2
when the job runs with ``TF_USE_LEGACY_KERAS=1``.
"""

import time

import numpy as np
import tensorflow as tf

import counter
import hvd.tensorflow.keras as hvd
from hvd.tensorflow.keras import elastic

keras = tf.keras


def resnet18(classes=1000):
    """ResNet-18 (11.7 M parameters) in Keras layers: the state a recovery is timed with."""
    layers = keras.layers

    def block(x, filters, stride):
        shortcut = x
        y = layers.Conv2D(filters, 3, stride, padding="same", use_bias=False)(x)
        y = layers.BatchNormalization()(y)
        y = layers.ReLU()(y)
        y = layers.Conv2D(filters, 3, 1, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        if stride != 1 or shortcut.shape[-1] != filters:
            shortcut = layers.Conv2D(filters, 1, stride, use_bias=False)(x)
            shortcut = layers.BatchNormalization()(shortcut)
        return layers.ReLU()(y + shortcut)

    inputs = keras.Input((224, 224, 3))
    x = layers.Conv2D(64, 7, 2, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    x = layers.MaxPooling2D(3, 2, padding="same")(x)
    for filters, stride in ((64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1),
                            (512, 2), (512, 1)):
        x = block(x, filters, stride)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(classes)(x))


def main():
    p = counter.parser(__doc__)
    p.add_argument("--fit", action="store_true",
                   help="train with model.fit, KerasState and the elastic callbacks")
    p.add_argument("--state-model", choices=["resnet18"], default=None,
                   help="a ResNet-18 (with SGD momentum slots) kept in the state besides the "
                        "counter, to time recovery with a real state")
    args = p.parse_args()
    counter.start()
    hvd.init()
    model = keras.Sequential([keras.Input((1,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0))
    extra = {}
    if args.state_model:
        big = resnet18()
        big_opt = keras.optimizers.SGD(learning_rate=0.0, momentum=0.9)
        big_opt.build(big.trainable_variables)
        extra = {"big": big, "big_optimizer": big_opt}
    resets = [0]
    if args.fit:
        train_fit(args, model, opt, extra, resets)
    else:
        train_loop(args, model, opt, extra, resets)


def check_ones(size, rank):
    ones = hvd.allreduce(tf.ones(16, dtype=tf.int64), op=hvd.Sum)
    if not bool(tf.reduce_all(ones == size)):
        raise SystemExit(f"rank {rank}: allreduce of ones gave {ones.numpy().tolist()} in a "
                         f"world of {size}")


def weight(model):
    return float(model.layers[0].kernel.numpy()[0, 0])


def train_loop(args, model, opt, extra, resets):
    opt.build(model.trainable_variables)
    state = elastic.TensorFlowKerasState(model, opt, step=0, total=0, history=[], **extra)
    state.register_reset_callbacks([lambda: resets.__setitem__(0, resets[0] + 1)])
    x = tf.ones((1, 1))
    calls = [0]

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @elastic.run
    def train(state):
        rank, size = hvd.rank(), hvd.size()
        counter.entered(calls, state, rank, size)
        while state.step < args.steps:
            check_ones(size, rank)
            train_step()
            counter.stepped(state, rank, size)
            counter.commit_or_check(state, args, rank)
        return rank, size

    rank, size = train(state)
    counter.done(state, weight(model), rank, size, resets[0], args.steps)
    hvd.shutdown()


class Counter(keras.callbacks.Callback):
    """The counter's step, taken at every batch of ``fit``."""

    def __init__(self, state, args):
        super().__init__()
        self.state = state
        self.args = args

    def on_train_batch_begin(self, batch, logs=None):
        check_ones(hvd.size(), hvd.rank())

    def on_train_batch_end(self, batch, logs=None):
        counter.stepped(self.state, hvd.rank(), hvd.size())
        time.sleep(self.args.step_ms / 1000)

    def on_epoch_end(self, epoch, logs=None):
        # The commit callback after this one commits the epoch.
        counter.emit({"event": "commit", "step": self.state.step, "rank": hvd.rank()})


def train_fit(args, model, opt, extra, resets):
    if args.steps % args.commit_every:
        raise SystemExit("--fit trains whole epochs of --commit-every steps: make --steps a "
                         "multiple of it")
    epochs = args.steps // args.commit_every
    # Gradient 1 for the one weight: the mean of the prediction on inputs of ones.
    model.compile(optimizer=opt, loss=lambda y, pred: tf.reduce_mean(pred), jit_compile=False)
    state = elastic.KerasState(model, step=0, total=0, history=[], batch=0, epoch=0, **extra)
    state.register_reset_callbacks([lambda: resets.__setitem__(0, resets[0] + 1)])
    data = (np.ones((args.commit_every, 1), np.float32), np.zeros((args.commit_every, 1),
                                                                   np.float32))
    calls = [0]
    # The commit runs last: it saves the epoch the callbacks before it just counted.
    callbacks = [Counter(state, args), elastic.UpdateBatchStateCallback(state),
                 elastic.UpdateEpochStateCallback(state),
                 elastic.CommitStateCallback(state, batches_per_commit=args.commit_every)]

    @elastic.run
    def train(state):
        rank, size = hvd.rank(), hvd.size()
        counter.entered(calls, state, rank, size)
        model.fit(*data, batch_size=1, epochs=epochs - state.epoch, callbacks=callbacks,
                  shuffle=False, verbose=0)
        return rank, size

    rank, size = train(state)
    counter.done(state, weight(model), rank, size, resets[0], args.steps)
    hvd.shutdown()


if __name__ == "__main__":
    main()
