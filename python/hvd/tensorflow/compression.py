"""Gradient compression for the wire, as Horovod's ``hvd.Compression`` for TensorFlow."""

import tensorflow as tf

from hvd.common.compression import CastCompressor, NoneCompressor


class FP16Compressor(CastCompressor):
    """Sends floating-point tensors as float16, halving their bytes."""

    wire = tf.float16
    floating = staticmethod(lambda t: t.dtype.is_floating)
    cast = staticmethod(tf.cast)


class Compression:
    """The compressions an allreduce or a ``DistributedGradientTape`` can use."""

    none = NoneCompressor
    fp16 = FP16Compressor
