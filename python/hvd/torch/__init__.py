"""Horovod's PyTorch API (``horovod.torch``) over hvd: ``import hvd.torch as hvd``.

Tensors go to the collectives without a copy when they are contiguous CPU tensors; others
are made contiguous (and CUDA tensors staged through host memory), reduced, and copied back.
Every call that waits on other ranks releases the GIL.
"""

from hvd.torch.compression import Compression
from hvd.torch.ops import *  # noqa: F401,F403 (the API, as ``ops.__all__`` lists it)
from hvd.torch.ops import __all__ as _ops_all
from hvd.torch.optimizer import DistributedOptimizer
from hvd.torch.sync_batch_norm import SyncBatchNorm
from hvd.torch import elastic

__all__ = sorted(set(_ops_all) | {"Compression", "DistributedOptimizer", "SyncBatchNorm",
                                  "elastic"})
