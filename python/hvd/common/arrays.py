"""Collectives on host memory as numpy arrays, shared by every framework binding: the object
collectives (pickled bytes) and the small gathers the others are built on. A framework
lends its CPU tensors' memory as numpy views, so nothing is copied on the way."""

import io
import pickle

import numpy as _np

from hvd import _hvd
from hvd.common.basics import _where, rank


def contiguous(array):
    """``array`` as a C-contiguous numpy array (itself when it is one already)."""
    return _np.ascontiguousarray(array)


def address(array):
    """The address of a contiguous numpy array's first element, for the native module."""
    return array.ctypes.data


def gather_counts(count, process_set=None):
    """Every rank's ``count`` (an int), in rank order (of ``process_set``'s ranks if given)."""
    sid, _, n = _where(process_set)
    mine = _np.array([count], dtype=_np.int64)
    out = _np.zeros(n, dtype=_np.int64)
    _hvd.allgather_into(address(mine), 1, "int64", 1, address(out), n, sid)
    return [int(c) for c in out]


def broadcast_(array, root_rank, process_set=None):
    """Copies the contiguous ``array`` from ``root_rank`` (a rank of the whole job) to every
    rank (of ``process_set``), in place."""
    sid, _, _ = _where(process_set)
    if sid is None:
        _hvd.broadcast_(address(array), array.size, str(array.dtype), root_rank)
    else:
        _hvd.broadcast_on_(sid, address(array), array.size, str(array.dtype), root_rank)
    return array


def broadcast_object(obj, root_rank=0, process_set=None):
    """Returns ``root_rank``'s ``obj`` (any picklable object) on every rank (of
    ``process_set``; ``root_rank`` is a rank of the whole job)."""
    if rank() == root_rank:
        payload = _np.frombuffer(pickle.dumps(obj), dtype=_np.uint8).copy()
        length = _np.array([payload.size], dtype=_np.int64)
    else:
        length = _np.zeros(1, dtype=_np.int64)
    broadcast_(length, root_rank, process_set)
    if rank() != root_rank:
        payload = _np.zeros(int(length[0]), dtype=_np.uint8)
    broadcast_(payload, root_rank, process_set)
    return pickle.load(io.BytesIO(payload.tobytes()))


def allgather_object(obj, process_set=None):
    """Returns every rank's ``obj`` (any picklable object), in rank order."""
    sid, _, _ = _where(process_set)
    payload = _np.frombuffer(pickle.dumps(obj), dtype=_np.uint8).copy()
    counts = gather_counts(payload.size, process_set)
    out = _np.empty(sum(counts), dtype=_np.uint8)
    _hvd.allgather_into(address(payload), payload.size, "uint8", 1, address(out), out.size,
                        sid)
    objs, at = [], 0
    for c in counts:
        objs.append(pickle.loads(out[at:at + c].tobytes()))
        at += c
    return objs
