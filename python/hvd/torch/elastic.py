"""Elastic training with PyTorch, as Horovod's ``hvd.elastic``: state that survives
membership changes, and the ``run`` decorator that drives them.

The rendezvous, the new round's mesh and the choice of the state's source stay in hvd's Rust
core; this module keeps the PyTorch objects and moves them with ``hvd.torch``'s broadcasts.
The rules are the Rust side's: the state comes from the rank holding the newest commit (new
members always receive it), a peer failure rolls every survivor back to its last commit, a
host change moves every rank on at the same step without rolling back, and the reset
callbacks run after every change.
"""

import copy
import functools
import math
import random
import sys

import torch

from hvd import _hvd
from hvd._hvd import HorovodInternalError, HostsUpdatedInterrupt
from hvd.torch import ops as _ops


class State:
    """State to commit, restore and synchronize; subclasses say what it holds."""

    def __init__(self):
        self._commits = 0
        self._handled_update = 0
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Adds functions called after every membership change, once the state is
        synchronized and before training resumes."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for cb in self._reset_callbacks:
            cb()

    def commit(self):
        """Saves the current state as the one to return to after a failure, then checks for
        host updates (raising ``HostsUpdatedInterrupt`` on every rank at the same step)."""
        self.save()
        self._commits += 1
        _hvd.count_step()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises ``HostsUpdatedInterrupt`` on every rank at once when the driver announced a
        host change to any of them; every rank must call it at the same point."""
        newest = _hvd.newest_update()
        if newest > self._handled_update:
            self._handled_update = newest
            raise HostsUpdatedInterrupt(f"hosts updated (update {newest})")

    def sync(self):
        """Makes every rank hold the newest committed state: that of the lowest rank among
        those with the most commits."""
        commits = _ops._gather_counts(self._commits)
        most = max(commits)
        self._sync_from(commits.index(most))
        self.save()
        self._commits = most
        self._handled_update = max(self._handled_update, _hvd.updates_through())
        _hvd.report_synced()

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def _sync_from(self, root):
        raise NotImplementedError

    def _forget_pending(self):
        """Drops what a failed round left in flight."""


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


def _stateful(v):
    """Values kept in place through their ``state_dict`` (a sampler a DataLoader holds)."""
    return hasattr(v, "state_dict") and hasattr(v, "load_state_dict") and not isinstance(
        v, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor))


class ObjectState(State):
    """State of plain attributes (any picklable values): ``state.epoch``, ``state.batch``."""

    def __init__(self, **kwargs):
        self._values = dict(kwargs)
        super().__init__()
        for k, v in kwargs.items():
            setattr(self, k, v)
        self._saved = {}
        self.save()

    def _snapshot(self):
        out = {}
        for k in self._values:
            v = getattr(self, k)
            out[k] = ("state_dict", v.state_dict()) if _stateful(v) else ("value", v)
        return out

    def _apply(self, snapshot):
        for k, (kind, v) in snapshot.items():
            if kind == "state_dict":
                getattr(self, k).load_state_dict(v)
            else:
                setattr(self, k, v)

    def save(self):
        self._saved = copy.deepcopy(self._snapshot())

    def restore(self):
        self._apply(copy.deepcopy(self._saved))

    def _sync_from(self, root):
        self._apply(_ops.broadcast_object(self._snapshot(), root))


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


def run(func):
    """Decorates ``func(state, *args, **kwargs)`` to run elastically: the state is
    synchronized before every call; on a peer failure every rank restores its last commit,
    on a host change it keeps its values, then it joins the driver's next round and calls
    ``func`` again. A worker the driver no longer needs exits 0."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        # A worker that joins a job past its first round has missed the resets before it.
        reset = _hvd.generation() > 1
        while True:
            try:
                state.sync()
                if reset:
                    _hvd.restore_process_sets()
                    state.on_reset()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                # Every rank raised it at the same step: keep the current values.
                state.save()
                state._commits += 1
                reason = str(e)
            except HorovodInternalError as e:
                state.restore()
                reason = str(e)
            _ops._handles.clear()
            state._forget_pending()
            # Generated op names restart with the round, as they start in a new worker.
            _ops._unnamed.clear()
            while True:
                try:
                    removed = _hvd.rejoin(reason)
                    break
                except HorovodInternalError:
                    continue  # a peer died while the new round connected: the next one
            if removed is not None:
                print(f"hvd: removed from the job ({removed}); exiting", file=sys.stderr)
                sys.exit(0)
            reset = True

    return wrapper


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

