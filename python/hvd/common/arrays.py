"""Collectives on host memory as numpy arrays, shared by every framework binding: the object
collectives (pickled bytes), the small gathers the others are built on, and the collectives
whose output size depends on every rank (allgather, alltoall, reducescatter). A framework
lends its CPU tensors' memory as numpy views and wraps the arrays returned here as tensors
without a copy, so one implementation serves them all.

``dtype`` arguments name the element type the native module sees when it differs from the
array's own: a framework whose bfloat16 numpy cannot hold lends it as a 16-bit view."""

import io
import pickle

import numpy as _np

from hvd import _hvd
from hvd.common.basics import _where, rank


def contiguous(array):
    """``array`` as a C-contiguous numpy array (itself when it is one already)."""
    return _np.require(array, requirements="C")  # a 0-d array keeps its shape


# Outputs are aligned as TensorFlow's kernels require of the memory they read (Eigen's
# widest vectors), so a framework can wrap them as tensors without a copy.
ALIGN = 64


def aligned(shape, dtype, nbytes=None):
    """An uninitialised C-contiguous array of ``shape`` (``nbytes`` bytes, when known) whose
    first element is ``ALIGN``-byte aligned, and that address (found once: numpy's address
    lookups cost microseconds)."""
    dtype = _np.dtype(dtype)
    if nbytes is None:
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
    raw = _np.empty(nbytes + ALIGN, dtype=_np.uint8)
    at = raw.ctypes.data
    start = (-at) % ALIGN
    return _np.ndarray(shape, dtype, raw, start), at + start


def empty(shape, dtype):
    """An uninitialised C-contiguous array whose first element is ``ALIGN``-byte aligned."""
    return aligned(tuple(int(d) for d in shape), dtype)[0]


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


def rows(shape):
    """A tensor of ``shape`` as rows along its first dimension: (rows, elements per row)."""
    if len(shape) == 0:
        return 1, 1
    per_row = 1
    for d in shape[1:]:
        per_row *= int(d)
    return int(shape[0]), per_row


def splits_of(splits, count, n):
    """``alltoall``'s ``splits`` (any sequence of ints, or None for equal parts) as a list of
    ``n`` row counts, checked against the ``count`` rows to send."""
    if splits is None:
        if count % n:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by "
                             f"the {n} ranks, not {count}")
        splits = [count // n] * n
    splits = [int(x) for x in (splits.tolist() if hasattr(splits, "tolist") else splits)]
    if len(splits) != n or any(x < 0 for x in splits) or sum(splits) != count:
        raise ValueError(f"alltoall splits {splits} must be {n} non-negative row counts "
                         f"summing to the first dimension, {count}")
    return splits


def _dtype(array, dtype):
    return dtype or array.dtype.name


def allgather(array, process_set=None, dtype=None):
    """Every rank's ``array`` concatenated along the first dimension, in rank order (of
    ``process_set``'s ranks); the first dimension may differ between ranks."""
    sid, _, _ = _where(process_set)
    array = contiguous(array)
    count, row_len = rows(array.shape)
    if row_len == 0:
        raise ValueError("allgather of rows with no elements")
    counts = gather_counts(count, process_set)
    out = empty((sum(counts),) + array.shape[1:], array.dtype)
    _hvd.allgather_into(address(array), array.size, _dtype(array, dtype), row_len,
                        address(out), out.size, sid)
    return out


def alltoall(array, splits=None, process_set=None, dtype=None):
    """Sends ``splits[p]`` rows (first-dimension slices) of ``array`` to rank ``p`` (equal
    parts without ``splits``); returns what every rank sent here, in rank order, and the
    list of rows that came from each."""
    sid, _, n = _where(process_set)
    array = contiguous(array)
    count, row_len = rows(array.shape)
    splits = splits_of(splits, count, n)
    mine = _np.array(splits, dtype=_np.int64)
    got = _np.zeros(n, dtype=_np.int64)
    _hvd.alltoall_into(address(mine), n, "int64", [1] * n, address(got), n, sid)
    received = [int(x) for x in got]
    out = empty((sum(received),) + array.shape[1:], array.dtype)
    _hvd.alltoall_into(address(array), array.size, _dtype(array, dtype),
                       [x * row_len for x in splits], address(out), out.size, sid)
    return out, received


def reducescatter(array, op, process_set=None, dtype=None):
    """Reduces ``array`` across ranks with ``op`` (a reduction's name) and returns this
    rank's rows of the result; the first ``rows % size`` ranks get one row more. Each rank
    receives only its rows: the reduction is scattered as it runs."""
    sid, r, n = _where(process_set)
    if array.ndim == 0:
        raise ValueError("reducescatter of a 0-dimensional tensor: it has no rows to scatter")
    array = contiguous(array)
    count = array.shape[0]
    base, extra = divmod(count, n)
    mine = base + (1 if r < extra else 0)
    if extra:
        # The engine scatters equal blocks of elements: give every rank's rows a block of the
        # same size, padding the ranks with a row fewer by one row (of zeros, then dropped).
        width = base + 1
        padded = _np.zeros((n * width,) + array.shape[1:], dtype=array.dtype)
        for p in range(n):
            start, length = p * base + min(p, extra), base + (1 if p < extra else 0)
            padded[p * width:p * width + length] = array[start:start + length]
        array, block = padded, width
    else:
        block = base
    out = empty((block,) + array.shape[1:], array.dtype)
    _hvd.reducescatter_into(address(array), array.size, _dtype(array, dtype), op,
                            address(out), out.size, sid)
    return out[:mine]
