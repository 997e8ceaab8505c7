"""Writes small MNIST-shaped files for driver/tests/tensorflow_examples.rs, in the format of
Keras' ``mnist.npz`` (``x_train``, ``y_train``, ``x_test``, ``y_test``; uint8 images and
labels), and prints their sha256.

    python mnist_npz.py DIR SIDE TRAIN TEST COUNT

writes ``DIR/mnist-0.npz`` .. ``DIR/mnist-<COUNT-1>.npz`` (what Horovod's examples load on each
rank), all the same: TRAIN and TEST images of SIDE×SIDE pixels, learnable, each dark but for a
bright block whose place is its label (two rows of five places), over faint noise.
"""

import hashlib
import os
import sys

import numpy as np


def images(n, side, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    x = rng.integers(0, 32, (n, side, side)).astype(np.uint8)
    h, w = max(side // 2, 1), max(side // 5, 1)
    for i, label in enumerate(labels):
        top, left = (label // 5) * h, (label % 5) * w
        x[i, top:top + h, left:left + w] = 255
    return x, labels


def main():
    out, side, train, test, count = sys.argv[1], *map(int, sys.argv[2:6])
    os.makedirs(out, exist_ok=True)
    x_train, y_train = images(train, side, 1)
    x_test, y_test = images(test, side, 2)
    first = os.path.join(out, "mnist-0.npz")
    np.savez(first, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    with open(first, "rb") as f:
        data = f.read()
    for rank in range(1, count):
        with open(os.path.join(out, f"mnist-{rank}.npz"), "wb") as f:
            f.write(data)
    print(hashlib.sha256(data).hexdigest())


if __name__ == "__main__":
    main()
