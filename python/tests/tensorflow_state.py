"""``TensorFlowKerasState``'s commit and rollback, in one process: every write since the
commit (optimizer steps, their slots and iteration count, a direct assign, a plain attribute)
is rolled back exactly, and the commit stays intact through the writes that follow a rollback
(the variables and the commit share no value that a write could change in place).
"""

import keras
import numpy as np
import tensorflow as tf

import hvd.tensorflow as hvd


def values(variables):
    return [np.array(v.numpy(), copy=True) for v in variables]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def main():
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    opt = keras.optimizers.Adam(learning_rate=0.1)
    opt.build(model.trainable_variables)
    state = hvd.elastic.TensorFlowKerasState(model, opt, epoch=0)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    everything = state._variables()
    step(tf.random.normal((4, 8)))
    state.commit()
    committed = values(everything)

    for _ in range(3):
        step(tf.random.normal((4, 8)))
    model.layers[0].kernel.assign(tf.ones_like(model.layers[0].kernel))
    state.epoch = 7
    assert not same(values(everything), committed), "the writes changed nothing"

    state.restore()
    assert same(values(everything), committed), "the rollback missed a write"
    assert state.epoch == 0
    # Writes after the rollback change the variables, never the commit they came from.
    step(tf.random.normal((4, 8)))
    model.layers[2].kernel.assign_add(tf.ones_like(model.layers[2].kernel))
    assert not same(values(everything), committed)
    state.restore()
    assert same(values(everything), committed), "a write after a rollback reached the commit"

    # A model built without its variables cannot be kept.
    try:
        hvd.elastic.TensorFlowKerasState(keras.Sequential([keras.layers.Dense(1)]))
    except ValueError as e:
        assert "built" in str(e), e
    else:
        raise AssertionError("an unbuilt model was accepted")
    # TF1 sessions are refused, naming the TF2 way.
    try:
        hvd.elastic.TensorFlowState(variables=[], session=object())
    except ValueError as e:
        assert "TensorFlow 2 has no sessions" in str(e), e
    else:
        raise AssertionError("a session was accepted")
    if hvd.size() > 1:
        # A model built differently on one rank: the first sync fails on every rank, naming
        # the ranks, instead of hanging in a broadcast of mismatched variables.
        width = 3 if hvd.rank() == 1 else 2
        odd = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width)])
        odd_state = hvd.elastic.TensorFlowKerasState(odd)
        try:
            odd_state.sync()
        except ValueError as e:
            assert "rank(s) [1]" in str(e), e
        else:
            raise AssertionError("a differently built model was synchronized")
        # Models built alike synchronize from rank 0.
        alike = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        alike_state = hvd.elastic.TensorFlowKerasState(alike)
        alike_state.sync()
        gathered = hvd.allgather_object(values(alike.variables))
        assert all(same(g, gathered[0]) for g in gathered), "ranks differ after a sync"
    print(f"tensorflow state ok: rank {hvd.rank()} of {hvd.size()}")


if __name__ == "__main__":
    main()
