"""Elastic training for every framework, as Horovod's ``horovod.common.elastic``: state that
survives membership changes, and the ``run`` decorator that drives them.

The rendezvous, the new round's mesh and the sync decision stay in hvd's Rust core
(``hvd::elastic``); this module keeps the framework's objects and the loop's Python side.
A framework's state says only how its objects are saved, restored and broadcast
(``hvd.torch.elastic.TorchState``, ``hvd.tensorflow.elastic.TensorFlowKerasState``,
``hvd.keras.elastic.KerasState``). The rules are the core's:

- the state comes from the lowest rank holding the newest commit, and only ranks that lack
  it receive it: new members always, survivors only when they are behind, so after a peer
  failure that left every survivor at the same commit nothing is sent at all;
- a peer failure rolls every survivor back to its last commit;
- a host change moves every rank on at the same step without rolling back;
- after every change the reset callbacks run on the ranks that lived through it, in the new
  round before the sync (as in Horovod: a callback may take part in collectives with the new
  members' first steps); a worker's first pass runs none, so a new worker sets what depends
  on the world when it builds its state.
"""

import copy
import functools
import math
import random
import sys

from hvd import _hvd
from hvd._hvd import HorovodInternalError, HostsUpdatedInterrupt
from hvd.common import arrays as _arrays
from hvd.common import handles as _handles

# Functions that turn a framework's wrapping of a collective's error back into hvd's: each
# takes an exception and returns a ``HorovodInternalError`` or ``HostsUpdatedInterrupt`` for
# it, or None. TensorFlow wraps what a collective raises inside ``tf.function`` in its own.
_translators = []


def register_error_translator(translate):
    """Adds ``translate(exception) -> HorovodInternalError | HostsUpdatedInterrupt | None``,
    consulted by ``run`` for exceptions that are not hvd's own."""
    if translate not in _translators:
        _translators.append(translate)


def _translated(e):
    if isinstance(e, (HorovodInternalError, HostsUpdatedInterrupt)):
        return e
    for translate in _translators:
        out = translate(e)
        if out is not None:
            return out
    return None


class State:
    """State to commit, restore and synchronize. A subclass says what it holds by
    ``save()`` (copy the current values aside), ``restore()`` (return to that copy) and
    ``_sync_from(root)`` (take rank ``root``'s current values, on every rank)."""

    def __init__(self):
        self._commits = 0
        # Never synchronized: this worker's values are only its own start.
        self._fresh = True
        self._handled_update = 0
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Adds functions called on every rank that lived through a membership change, in
        the new round before the state is synchronized (a new worker's first pass runs
        none, as in Horovod)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Runs the reset callbacks."""
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
        """Makes every rank hold the newest committed state, sending it only to the ranks
        that lack it (the core decides: ``hvd::elastic::sync_plan``)."""
        root, commits, receivers = _hvd.sync_plan(self._commits, self._fresh)
        if receivers:
            self._sync_from(root)
            if _hvd.topology()[0] in receivers:
                self.save()
        self._in_new_world()
        self._commits = commits
        self._fresh = False
        self._handled_update = max(self._handled_update, _hvd.updates_through())
        _hvd.report_synced()

    def save(self):
        """Copies the current values aside, as the state to return to."""
        raise NotImplementedError

    def restore(self):
        """Returns the values to the last ``save()``."""
        raise NotImplementedError

    def _sync_from(self, root):
        """Replaces the current values on every rank with rank ``root``'s."""
        raise NotImplementedError

    def _forget_pending(self):
        """Drops what a failed round left in flight (an optimizer's pending reductions)."""

    def _in_new_world(self):
        """Recomputes what depends on the world after a sync, which may have sent nothing."""


def _stateful(v):
    """Values kept in place through their ``state_dict`` (a sampler a data loader holds)."""
    return hasattr(v, "state_dict") and hasattr(v, "load_state_dict")


class ObjectState(State):
    """State of plain attributes (any picklable values): ``state.epoch``, ``state.batch``;
    a value with ``state_dict``/``load_state_dict`` (a sampler) is kept through them, in
    place."""

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
        self._apply(_arrays.broadcast_object(self._snapshot(), root))

    def _in_new_world(self):
        # A value kept through its state_dict (an ElasticSampler) splits its work over the
        # world when it loads one: loading its own makes it follow the new world.
        for k in self._values:
            v = getattr(self, k)
            if _stateful(v):
                v.load_state_dict(v.state_dict())


class ElasticSampler:
    """Splits a dataset's indices (``dataset`` is anything with a length) over the current
    ranks so that, across resizes, no sample of an epoch is repeated and none skipped: keep
    it in the elastic state, and record each batch as it is processed. Any framework's: an
    iterable of this rank's indices (``hvd.torch.elastic.ElasticSampler`` is also a PyTorch
    ``Sampler``)."""

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
        self.num_replicas = _hvd.topology()[1]
        self.rank = _hvd.topology()[0]
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


def run(func):
    """Decorates ``func(state, *args, **kwargs)`` to run elastically: the state is
    synchronized before every call; on a peer failure every rank restores its last commit,
    on a host change it keeps its values, then it joins the driver's next round and calls
    ``func`` again. A worker the driver no longer needs exits 0."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        # As in Horovod: after a change the reset callbacks run first, then the sync; a
        # worker's first pass (a new worker's too) only syncs.
        reset = False
        while True:
            try:
                if reset:
                    state.on_reset()
                # Then every member of a round past the job's first rebuilds the process
                # sets (a collective), new workers too: a callback's collectives pair with
                # what a new worker runs before its state, as in Horovod.
                if reset or _hvd.generation() > 1:
                    _hvd.restore_process_sets()
                state.sync()
                return func(state, *args, **kwargs)
            except Exception as raised:  # noqa: BLE001 (only hvd's own are handled)
                e = _translated(raised)
                if e is None:
                    raise
                reason = str(e)
                failed = not isinstance(e, HostsUpdatedInterrupt)
                if not failed:
                    # Every rank raised it at the same step: keep the current values.
                    state.save()
                    state._commits += 1
            _handles.forget_all()
            state._forget_pending()
            # No op of the failed round writes into a tensor once the engine stopped: the
            # rollback then runs while the next round forms (both release the GIL).
            try:
                _hvd.stop_engine()
            except HorovodInternalError:
                pass  # stopped all the same: a broken round's engine ends with an error
            # The next round forms on a thread of the native module's (which needs no GIL)
            # while this one rolls the state back: the rejoin starts at once.
            rejoin = _hvd.rejoin_start(reason)
            try:
                if failed:
                    state.restore()
            finally:
                removed = rejoin.wait()
            if removed is not None:
                print(f"hvd: removed from the job ({removed}); exiting", file=sys.stderr)
                sys.exit(0)
            reset = True

    return wrapper


__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "register_error_translator", "run"]
