"""hvd: elastic, fault-tolerant distributed training with Horovod's API.

Framework bindings live in submodules: ``import hvd.torch as hvd`` is Horovod's
``import horovod.torch as hvd``.
"""

from hvd._hvd import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
