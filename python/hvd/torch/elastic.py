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
from hvd import _hvd
from hvd.torch import ops as _ops


class _Kept:
    """A copy of one ``state_dict``, kept in the same tensors from one commit to the next (no
    fresh memory to fault in), and written back into the live tensors in place."""

    def __init__(self):
        self.copy = None

    def _clone(self, value, into, copies):
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if (isinstance(into, torch.Tensor) and into.shape == value.shape
                    and into.dtype == value.dtype and into.device == value.device):
                copies.append((into, value))
                return into
            return value.clone()
        if isinstance(value, dict):
            old = into if isinstance(into, dict) else {}
            return type(value)((k, self._clone(v, old.get(k), copies)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            old = into if isinstance(into, (list, tuple)) and len(into) == len(value) else \
                [None] * len(value)
            return type(value)(self._clone(v, o, copies) for v, o in zip(value, old))
        return copy.deepcopy(value)

    def save(self, state_dict):
        """Copies ``state_dict`` aside, into the tensors of the previous copy."""
        copies = []
        self.copy = self._clone(state_dict, self.copy, copies)
        _copy_all(copies, written=False)

    def restore_tensors(self, live, saved):
        """Writes the tensors of ``saved`` (part of the copy) back into ``live``'s, in place;
        False, with nothing written, when their layouts differ."""
        pairs = []
        if not _pairs(live, saved, pairs):
            return False
        _copy_all(pairs, written=True)
        return True

    def loadable(self):
        """The copy as a ``state_dict`` to load whole, sharing no memory with the copy kept."""
        return self._clone(self.copy, None, [])


def _bytewise(dst, src):
    """Whether ``src`` can be copied into ``dst`` as plain bytes: both dense CPU tensors of
    one layout."""
    return (dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous()
            and src.is_contiguous() and not dst.is_conj() and not src.is_conj()
            and not dst.is_neg() and not src.is_neg())


def _copy_all(pairs, written):
    """Copies each ``(dst, src)`` pair of same-shaped tensors: CPU ones in one native call
    without the GIL and outside PyTorch's thread pool (workers sharing a host would
    oversubscribe it: a 94 MB commit took 150-300 ms at 4 workers on 2 cores, against 20-40),
    the others with ``copy_``. ``written``: the destinations are live tensors, whose
    version counters move as an in-place write's would."""
    regions, native, rest = [], [], []
    for dst, src in pairs:
        if _bytewise(dst, src):
            regions.append((dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()))
            native.append(dst)
        else:
            rest.append((dst, src))
    if regions:
        _hvd.copy_regions(regions)
        if written:
            for dst in native:
                _ops._written(dst)
    with torch.no_grad():
        for dst, src in rest:
            dst.copy_(src)


def _pairs(live, saved, out):
    """Collects the (live, saved) tensor pairs of two ``state_dict`` parts; False when their
    layouts differ."""
    if isinstance(live, torch.Tensor):
        if not (isinstance(saved, torch.Tensor) and saved.shape == live.shape
                and saved.dtype == live.dtype):
            return False
        out.append((live.detach(), saved))
        return True
    if isinstance(live, dict):
        return (isinstance(saved, dict) and saved.keys() == live.keys()
                and all(_pairs(live[k], saved[k], out) for k in live))
    return True


def _restore_module(module, kept):
    if not kept.restore_tensors(module.state_dict(), kept.copy):
        module.load_state_dict(kept.copy)


def _restore_optimizer(opt, kept):
    """Writes the optimizer's saved state back in place (its live state tensors, its other
    state values and its groups' hyperparameters), or loads it whole when its layout moved."""
    saved = kept.copy
    params = [p for g in opt.param_groups for p in g["params"]]
    live = opt.state_dict()
    same = (len(saved["param_groups"]) == len(opt.param_groups)
            and set(saved["state"]) == set(live["state"])
            and kept.restore_tensors(live["state"], saved["state"]))
    if not same:
        # An optimizer loads the tensors it is given as its own: give it a copy.
        opt.load_state_dict(kept.loadable())
        return
    for idx, entries in saved["state"].items():
        for k, v in entries.items():
            if not isinstance(v, torch.Tensor):
                opt.state[params[idx]][k] = copy.deepcopy(v)
    for group, kept_group in zip(opt.param_groups, saved["param_groups"]):
        for k, v in kept_group.items():
            if k != "params":
                group[k] = copy.deepcopy(v)


class TorchState(ObjectState):
    """State of a model and an optimizer (their ``state_dict``s) and any other attributes:
    modules and optimizers among them are kept the same way, a sampler through its
    ``state_dict`` (so an ``ElasticSampler`` keeps its place in the epoch), other values by
    value. A commit copies the tensors into those of the previous commit, and a rollback
    writes them back in place: the live tensors never share memory with the copy."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        torch_kwargs = {"model": model, "optimizer": optimizer}
        torch_kwargs.update({k: v for k, v in kwargs.items()
                             if isinstance(v, (torch.nn.Module, torch.optim.Optimizer))})
        self._modules_ = {k: v for k, v in torch_kwargs.items()
                          if isinstance(v, torch.nn.Module)}
        self._optimizers_ = {k: v for k, v in torch_kwargs.items()
                             if isinstance(v, torch.optim.Optimizer)}
        self._kept = {k: _Kept() for k in {**self._modules_, **self._optimizers_}}
        super().__init__(**{k: v for k, v in kwargs.items() if k not in torch_kwargs})
        for k, v in torch_kwargs.items():
            setattr(self, k, v)

    def save(self):
        for k, v in {**self._modules_, **self._optimizers_}.items():
            self._kept[k].save(v.state_dict())
        super().save()

    def restore(self):
        for k, v in self._modules_.items():
            _restore_module(v, self._kept[k])
        for k, v in self._optimizers_.items():
            _restore_optimizer(v, self._kept[k])
        super().restore()

    def _forget_pending(self):
        for opt in self._optimizers_.values():
            reset = getattr(opt, "_hvd_reset", None)
            if reset is not None:
                reset()

    def _sync_from(self, root):
        # One object broadcast (the optimizers' layouts and the plain values), then every
        # tensor at once, fused by the engine.
        layouts, snapshot = _ops.broadcast_object(
            ({k: _ops._optimizer_layout(o) for k, o in self._optimizers_.items()},
             self._snapshot()), root)
        tensors, loads = [], []
        for k, module in self._modules_.items():
            tensors += [(f"sync.{k}.{name}", t) for name, t in sorted(module.state_dict().items())
                        if isinstance(t, torch.Tensor)]
        for k, opt in self._optimizers_.items():
            named, load = _ops._optimizer_receiver(opt, layouts[k], f"sync.{k}")
            tensors += named
            loads.append(load)
        _ops._broadcast_all(tensors, root)
        if _ops.rank() != root:
            for load in loads:
                load()
            self._apply(snapshot)


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

