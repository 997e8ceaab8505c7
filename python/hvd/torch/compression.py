"""Gradient compression for the wire, as Horovod's ``hvd.Compression``."""

import torch

from hvd.common.compression import CastCompressor, NoneCompressor


class FP16Compressor(CastCompressor):
    """Sends floating-point tensors as float16, halving their bytes."""

    wire = torch.float16
    floating = staticmethod(lambda t: t.dtype.is_floating_point)
    cast = staticmethod(lambda t, dtype: t.to(dtype))


class Compression:
    """The compressions a ``DistributedOptimizer`` or an allreduce can use."""

    none = NoneCompressor
    fp16 = FP16Compressor
