"""hvd: elastic, fault-tolerant distributed training with Horovod's API.

Framework bindings live in submodules: ``import hvd.torch as hvd`` is Horovod's
``import horovod.torch as hvd``. ``hvd.run`` is Horovod's ``horovod.run``.
"""

from hvd._hvd import HorovodInternalError, HostsUpdatedInterrupt
from hvd.runner import run

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "run"]
