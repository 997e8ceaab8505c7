"""Test-only, on the PYTHONPATH of driver/tests/tensorflow_examples.rs's workers alone: lets
Keras' MNIST loader accept the small MNIST files the test generated, so Horovod's examples
train without a network.

``mnist.load_data(path)`` (Keras 3's and tf_keras's) calls ``get_file(path, origin=<Keras'
mnist.npz>, file_hash=MNIST_SHA256)``, which checks a cached file's sha256 against the real
file's and downloads the real one on a mismatch. This module wraps the ``validate_file`` that
``get_file`` calls (``keras.src.utils.file_utils`` and ``tf_keras.src.utils.data_utils``, as
each is imported): a check against the real MNIST's hash also passes when the file's own
sha256 is one that ``HVD_TEST_MNIST_SHA256`` lists (comma-separated: the files the test
wrote). Every other file and hash is checked as before, and nothing else changes.
"""

import hashlib
import importlib.abc
import importlib.machinery
import os
import sys

MNIST_SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"
MODULES = {"keras.src.utils.file_utils", "tf_keras.src.utils.data_utils"}
ACCEPTED = set(filter(None, os.environ.get("HVD_TEST_MNIST_SHA256", "").split(",")))


def _accept_generated_mnist(module):
    validate_file = module.validate_file

    def validate(fpath, file_hash, *args, **kwargs):
        if file_hash == MNIST_SHA256:
            with open(fpath, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() in ACCEPTED:
                    return True
        return validate_file(fpath, file_hash, *args, **kwargs)

    module.validate_file = validate


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the two modules as Python would, and wraps their ``validate_file`` once loaded."""

    def find_spec(self, name, path, target=None):
        if name not in MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _accept_generated_mnist(module)

        spec.loader.exec_module = exec_and_wrap
        return spec


if ACCEPTED:
    sys.meta_path.insert(0, _Finder())
