"""Elastic training with PyTorch, as Horovod's ``horovod.torch.elastic``: ``TorchState``
and ``ElasticSampler`` on hvd's one elastic core (``hvd.elastic``: ``State``, ``ObjectState``,
``run``), which decides every sync in Rust. This module says only how PyTorch objects are
saved, restored and broadcast.
"""

import copy
import math
import random

import torch

from hvd.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState,  # noqa: F401
                         State, run)
from hvd.torch import ops as _ops


def _clone(value, into=None):
    """A copy of a ``state_dict``: tensors copied into the tensors of the previous copy
    ``into`` where their shapes and types still match (no fresh memory to fault in), cloned
    otherwise; containers rebuilt; other values deep-copied."""
    if isinstance(value, torch.Tensor):
        if (isinstance(into, torch.Tensor) and into.shape == value.shape
                and into.dtype == value.dtype and into.device == value.device):
            return into.copy_(value.detach())
        return value.detach().clone()
    if isinstance(value, dict):
        old = into if isinstance(into, dict) else {}
        return type(value)((k, _clone(v, old.get(k))) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        old = into if isinstance(into, (list, tuple)) and len(into) == len(value) else \
            [None] * len(value)
        return type(value)(_clone(v, o) for v, o in zip(value, old))
    return copy.deepcopy(value)


class TorchState(ObjectState):
    """State of a model and an optimizer (their ``state_dict``s) and any other attributes:
    modules and optimizers among them are kept the same way, a sampler through its
    ``state_dict`` (so an ``ElasticSampler`` keeps its place in the epoch), other values by
    value."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        torch_kwargs = {"model": model, "optimizer": optimizer}
        torch_kwargs.update({k: v for k, v in kwargs.items()
                             if isinstance(v, (torch.nn.Module, torch.optim.Optimizer))})
        self._modules_ = {k: v for k, v in torch_kwargs.items()
                          if isinstance(v, torch.nn.Module)}
        self._optimizers_ = {k: v for k, v in torch_kwargs.items()
                             if isinstance(v, torch.optim.Optimizer)}
        self._saved_torch = {}
        super().__init__(**{k: v for k, v in kwargs.items() if k not in torch_kwargs})
        for k, v in torch_kwargs.items():
            setattr(self, k, v)

    def save(self):
        self._saved_torch = {k: _clone(v.state_dict(), self._saved_torch.get(k))
                             for k, v in {**self._modules_, **self._optimizers_}.items()}
        super().save()

    def restore(self):
        for k, v in {**self._modules_, **self._optimizers_}.items():
            v.load_state_dict(self._saved_torch[k])
        super().restore()

    def _forget_pending(self):
        for opt in self._optimizers_.values():
            reset = getattr(opt, "_hvd_reset", None)
            if reset is not None:
                reset()

    def _sync_from(self, root):
        for module in self._modules_.values():
            _ops.broadcast_parameters(module.state_dict(), root_rank=root)
        for opt in self._optimizers_.values():
            _ops.broadcast_optimizer_state(opt, root_rank=root)
        super()._sync_from(root)


class ElasticSampler(torch.utils.data.Sampler):
    """Splits a dataset's indices over the current ranks so that, across resizes, no sample
    of an epoch is repeated and none skipped: keep it in the ``TorchState``, and record each
    batch as it is processed."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch):
        """Starts epoch ``epoch``: nothing of it processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Counts a batch of ``batch_size`` per rank as processed by every rank."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices):
        """Counts ``indices`` (this rank's) as processed, for every rank."""
        self.processed_num += len(indices) * self.num_replicas

    def reset(self):
        """Re-reads the world (after a membership change) and splits what is left of the
        epoch over it."""
        self.num_replicas = _ops.size()
        self.rank = _ops.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining = order[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining) / self.num_replicas))
        total = self.num_samples * self.num_replicas
        padded = self.remaining + self.remaining[:total - len(self.remaining)]
        self.indices = padded[self.rank:total:self.num_replicas]

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]
        self.processed_num = state["processed_num"]
        self.reset()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples

