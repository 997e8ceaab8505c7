"""Elastic training with PyTorch, as Horovod's ``horovod.torch.elastic``: ``TorchState``
and ``ElasticSampler`` on hvd's one elastic core (``hvd.elastic``: ``State``, ``ObjectState``,
``run``), which decides every sync in Rust. This module says only how PyTorch objects are
saved, restored and broadcast.
"""

import copy

import torch

from hvd import elastic as _elastic
from hvd.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState,  # noqa: F401
                         State, run)
from hvd import _hvd
from hvd.torch import ops as _ops


# PyTorch's copy-on-write clones (2.2 and later): a clone that shares its source's memory until
# either is written, when the writer gets a copy of its own (``data_ptr()``, ``numpy()`` and
# every in-place operator included).
_lazy_clone = getattr(torch, "_lazy_clone", None)
_is_cow = getattr(torch._C, "_is_cow_tensor", None)


class _Kept:
    """A copy of one ``state_dict``, kept in the same tensors from one commit to the next (no
    fresh memory to fault in), and live CPU tensors that share the copy's memory while they
    hold what it holds, as copy-on-write clones of it.

    A commit copies a tensor only when it was written since it was handed a clone (a write,
    by any means, gives the writer memory of its own, which is how a written one is told
    apart), and hands a clone to each tensor that no in-place operator wrote since the commit
    before (its version counter says so: a hint only, as the clone keeps every write from the
    copy), so that tensors nothing trains, a frozen backbone or an optimizer's unused
    buffers, cost no copy at any later commit or rollback. A rollback leaves a tensor that
    still holds its clone alone, hands a clone to one no in-place operator wrote since the
    commit, and copies the commit back into the others, in place (into memory already
    faulted in, where a clone's first write would copy into fresh memory)."""

    def __init__(self):
        self.copy = None
        # The clones handed over, and the tensor of the copy each is a clone of, by the
        # address of the clone's storage (held, so that no other storage takes an address
        # while it is listed).
        self.handed = {}
        # The memory taken from live tensors when clones replaced it, freed at the next
        # commit: freeing it is a rollback's only cost in proportion to the state (the
        # allocator returns large blocks to the kernel, 8 ms for a ResNet-18's 94 MB), paid
        # where training goes on rather than while the job waits.
        self.released = []
        # Each copied tensor's live tensor and its version when the copy was made, by the
        # copy's id: which live tensors an in-place operator wrote since.
        self.versions = {}

    def _unwritten(self, value, into):
        """Whether ``value`` still holds a clone of ``into`` handed over earlier, unwritten: it
        holds what ``into`` holds."""
        if not self.handed or not _is_cow(value):
            return False
        _, source = self.handed.get(value.untyped_storage()._cdata, (None, None))
        return source is into

    def _quiet(self, live, kept):
        """Whether no in-place operator wrote ``live`` since ``kept`` was copied from it (a
        hint that nothing trains it) and a clone of ``kept`` can replace its data."""
        at_copy = self.versions.get(id(kept))
        return (at_copy is not None and at_copy[0] is live and at_copy[1] == live._version
                and _lazy_clone is not None and _bytewise(live, kept) and _whole(live))

    def _hand(self, live, kept):
        """Gives the live tensor ``live`` a copy-on-write clone of ``kept`` as its data."""
        clone = _lazy_clone(kept)
        self.released.append(live.data)
        live.data = clone
        self.handed[clone.untyped_storage()._cdata] = (clone, kept)

    def _clone(self, value, into, copies):
        if isinstance(value, torch.Tensor):
            if (isinstance(into, torch.Tensor) and into.shape == value.shape
                    and into.dtype == value.dtype and into.device == value.device):
                copies.append((into, value))
                return into
            return value.detach().clone()
        if isinstance(value, dict):
            old = into if isinstance(into, dict) else {}
            return type(value)((k, self._clone(v, old.get(k), copies)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            old = into if isinstance(into, (list, tuple)) and len(into) == len(value) else \
                [None] * len(value)
            return type(value)(self._clone(v, o, copies) for v, o in zip(value, old))
        return copy.deepcopy(value)

    def save(self, state_dict):
        """Copies ``state_dict`` (``state_dict(keep_vars=True)``'s, or an optimizer's: the
        live tensors themselves) aside, into the tensors of the previous copy, as the class
        says."""
        pairs = []
        self.copy = self._clone(state_dict, self.copy, pairs)
        # The memory clones replaced since the last commit: what is still shared stays
        # listed in `handed`, a clone that was written holds its own memory by now.
        self.released = []
        handed, versions, copies, unchanged = {}, {}, [], []
        for kept, live in pairs:
            if self._unwritten(live, kept):
                cdata = live.untyped_storage()._cdata
                handed[cdata] = self.handed[cdata]
                continue
            copies.append((kept, live.detach()))
            if self._quiet(live, kept):
                unchanged.append((live, kept))
            else:
                versions[id(kept)] = (live, live._version)
        # A written tensor gave up its clone: the copy is again the only user of its
        # memory, so writing it copies nothing first.
        self.handed, self.versions = handed, versions
        _copy_all(copies, written=False)
        for live, kept in unchanged:
            self._hand(live, kept)

    def restore_tensors(self, live, saved):
        """Returns the tensors of ``live`` (``state_dict(keep_vars=True)``'s, or an
        optimizer's state) to ``saved`` (part of the copy), as the class says: one that holds
        an unwritten clone is left alone, a quiet one (``_quiet``) gets a clone, the others are
        written in place. False, with nothing changed, when their layouts differ."""
        pairs = []
        if not _pairs(live, saved, pairs):
            return False
        written = []
        for t, kept in pairs:
            if self._unwritten(t, kept):
                continue
            if self._quiet(t, kept):
                # No in-place operator wrote it since the commit: likely none will soon, so a
                # clone, which costs a copy only when written, beats copying it back now.
                del self.versions[id(kept)]
                self._hand(t, kept)
            else:
                # Written, and likely written again: copied back into its own memory, which
                # is warm, where a clone's first write would copy into fresh memory.
                written.append((t.detach(), kept))
        _copy_all(written, written=True)
        return True

    def loadable(self):
        """The copy as a ``state_dict`` to load whole, sharing no memory with the copy kept."""
        return self._clone(self.copy, None, [])


def _whole(t):
    """Whether ``t`` is a tensor of its own, not a view: its data can be replaced without
    parting it from other tensors over the same memory."""
    return (t._base is None and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _bytewise(dst, src):
    """Whether ``src`` can be copied into ``dst`` as plain bytes: both dense CPU tensors of
    one layout."""
    return (dst.layout is torch.strided and src.layout is torch.strided
            and dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous()
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
        out.append((live, saved))
        return True
    if isinstance(live, dict):
        return (isinstance(saved, dict) and saved.keys() == live.keys()
                and all(_pairs(live[k], saved[k], out) for k in live))
    return True


def _restore_module(module, kept):
    if not kept.restore_tensors(module.state_dict(keep_vars=True), kept.copy):
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
    copies them back in place, except that a live CPU tensor nothing wrote in place since a
    commit shares the copy's memory as a copy-on-write clone of it, which commits and
    rollbacks then skip (``_Kept``): a write to a live tensor never reaches the copy, nor one
    to the copy a live tensor."""

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
        for k, v in self._modules_.items():
            self._kept[k].save(v.state_dict(keep_vars=True))
        for k, v in self._optimizers_.items():
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


class ElasticSampler(_elastic.ElasticSampler, torch.utils.data.Sampler):
    """``hvd.elastic.ElasticSampler`` as a PyTorch ``Sampler``, for a ``DataLoader``."""

