"""The collectives of ``hvd.tensorflow``, eager and inside ``tf.function``.

Each collective is a kernel over numpy arrays (``hvd.common.arrays`` and the native
module) that ``buffers.run`` calls on eager tensors' own memory or as a graph node; the
copies that remain are listed in ``hvd.tensorflow.buffers``. Gradients are Horovod's: an
allreduce's is the same allreduce of the output's gradient, an allgather's is this rank's
rows of the averaged gradient, a broadcast's is the averaged gradient on the root and zeros
elsewhere, an alltoall's is the alltoall back, a reducescatter's the allgather of its
gradient (times the ranks for a sum).
"""

import re

import numpy as _np
import tensorflow as tf

from hvd import _hvd
from hvd._hvd import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from hvd.common import arrays as _arrays
from hvd.common.basics import *  # noqa: F401,F403
from hvd.common.basics import _op_of, _where
from hvd.common.handles import _name, _unnamed
from hvd.tensorflow import buffers as _buf
from hvd.tensorflow import graph_ops as _graph_ops
from hvd.tensorflow.compression import Compression, NoneCompressor

try:
    # Not ``type(tf.constant(0))``: that would start TensorFlow's context at import, before
    # a script configures its devices.
    from tensorflow.python.framework.ops import EagerTensor as _EagerTensor
except ImportError:  # pragma: no cover (a TensorFlow that moved it: the general path)
    _EagerTensor = None


def _node_name(kind, name, tensor):
    """The graph node's name: ``name``, or Horovod's ``Horovod<Kind>_<input>``."""
    if name is None:
        base = getattr(tensor, "name", None) if not tf.executing_eagerly() else None
        name = f"Horovod{kind}_{base}" if base else f"Horovod{kind}"
    return re.sub("[^a-zA-Z0-9_]", "_", str(name))


def _rest(shape):
    """A static shape with an unknown first dimension and the rest of ``shape``."""
    shape = tf.TensorShape(shape)
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None]).concatenate(shape[1:]) if shape.rank else \
        tf.TensorShape([None])


def _scale(array, factor):
    if factor != 1.0:
        array *= array.dtype.type(factor)


def _sid(process_set):
    """The native id of ``process_set`` (None for the whole job), checking that this rank
    is a member."""
    if process_set is global_process_set or process_set is None:
        return None
    return _where(process_set)[0]


def _reduce_into(out, at, op, process_set):
    """Reduces the contiguous array ``out`` (at address ``at``) in place across the ranks
    of ``process_set``."""
    sid = _sid(process_set)
    if sid is None:
        _hvd.allreduce_(at, out.size, _buf.name_of(out), op.name)
    else:
        _hvd.allreduce_on_(sid, at, out.size, _buf.name_of(out), op.name)
    return out


def _reduced(array, op, prescale, postscale, process_set):
    """A reduced copy of ``array``."""
    out, at = _buf.aligned_copy(array)
    _scale(out, prescale)
    _reduce_into(out, at, op, process_set)
    _scale(out, postscale)
    return out


def _compiled(process_set):
    """hvd's compiled op module where a graph being built can use it: whole-job allreduces
    (a process set's run as ``numpy_function`` nodes)."""
    if tf.executing_eagerly() or _sid(process_set) is not None:
        return None
    return _graph_ops.library()


def _allreduce(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
               ignore_name_scope=False, process_set=global_process_set):
    """Horovod's raw allreduce op (default: the sum) on a dense tensor, differentiable."""
    x = _buf.as_tensor(tensor)
    _buf.reducible(x, "allreduce", op)
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        _buf.scalable(x, prescale_factor, "prescale_factor")
        _buf.scalable(x, postscale_factor, "postscale_factor")

    def kernel(a):
        return [_reduced(a, op, prescale_factor, postscale_factor, process_set)]

    if _buf.direct():
        return _buf.tensor_of(kernel(_buf.array_of(x))[0], aligned=True)
    if not tf.executing_eagerly():
        _where(process_set)
    node = _node_name("Allreduce", name, x)

    def forward(x):
        lib = _compiled(process_set)
        if lib is not None:
            return lib.hvd_grouped_allreduce([x], reduce_op=op.name,
                                             prescale_factor=prescale_factor,
                                             postscale_factor=postscale_factor, name=node)
        return _buf.run(kernel, [x], [x.dtype], [x.shape], node, aligned=True)

    def grad(ys, dy):
        return _allreduce(dy, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set)

    if not x.dtype.is_floating:
        return forward(x)[0]
    return _buf.differentiable(forward, [x], grad)[0]


def allreduce(tensor, average=None, device_dense='', device_sparse='',
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Returns the reduction of ``tensor`` (a tensor, variable or ``tf.IndexedSlices``)
    across all ranks or ``process_set``'s (default: the average), sent as ``compression``
    says. An ``IndexedSlices`` is allgathered (values and indices; an average divides the
    values by the ranks), as Horovod does. ``device_*`` are accepted for Horovod's
    signature: hvd reduces in host memory. Differentiable: the gradient is the same
    allreduce of the output's gradient."""
    op = _op_of(average, op)
    if type(tensor) is _EagerTensor and compression is NoneCompressor and \
            process_set is global_process_set and prescale_factor == 1.0 and \
            postscale_factor == 1.0 and op is not Adasum and _buf.direct():
        # The common eager call, tensor to tensor in one native call (DLPack both ways);
        # None for what takes the general way (another device or element type).
        out = _buf.allreduced(tensor, op)
        if out is not None:
            return out
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, op, prescale_factor, postscale_factor, process_set,
                                 ignore_name_scope)
    return _compressed(_allreduce, tensor, compression, name=name, op=op,
                       prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                       process_set=process_set)


def _compressed(raw, tensor, compression, **kwargs):
    """``raw(wire, **kwargs)``, a reducing op, of ``tensor`` sent as ``compression`` says;
    on ``tensor``'s device."""
    if compression is NoneCompressor and type(tensor) is _EagerTensor and \
            "GPU" not in tensor.device:
        return raw(tensor, **kwargs)  # the common case, without the layers it needs not
    x = _buf.as_tensor(tensor)
    wire, ctx = compression.compress(x)
    return _buf.on_device_of(x, compression.decompress(raw(wire, **kwargs), ctx))


def _sparse_allreduce(slices, op, prescale_factor, postscale_factor, process_set,
                      ignore_name_scope=False):
    """Horovod's allreduce of a ``tf.IndexedSlices``: its values and indices allgathered."""
    if op is Adasum:
        raise NotImplementedError("hvd.Adasum does not reduce tf.IndexedSlices: pass "
                                  "sparse_as_dense=True to reduce them as dense tensors")
    if op not in (Sum, Average):
        raise NotImplementedError("tf.IndexedSlices are reduced with hvd.Sum or hvd.Average "
                                  f"only, not {op!r}")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("prescale_factor and postscale_factor do not apply to "
                                  "tf.IndexedSlices")
    values = allgather(slices.values, process_set=process_set,
                       ignore_name_scope=ignore_name_scope)
    indices = allgather(slices.indices, process_set=process_set,
                        ignore_name_scope=ignore_name_scope)
    if op is Average:
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _grouped_kernel(op, prescale, postscale, process_set, name, node=()):
    """Reduces a list of arrays as one fused op of the background engine (every op in
    flight before any is waited for); on a process set, one after another. Inside a graph
    ``node`` holds the node's name, which names the engine's ops as the compiled op names
    them, so ranks on either path agree."""

    def kernel(*arrays):
        copies = [_buf.aligned_copy(a) for a in arrays]
        outs = [o for o, _ in copies]
        for o in outs:
            _scale(o, prescale)
        if _sid(process_set) is None:
            base = node[0] if node else _name("grouped_allreduce", name)
            pending = [_hvd.allreduce_async_(at, o.size, _buf.name_of(o), op.name,
                                             f"{base}.{i}", o)
                       for i, (o, at) in enumerate(copies)]
            for p in pending:
                p.wait()
        else:
            for o, at in copies:
                _reduce_into(o, at, op, process_set)
        for o in outs:
            _scale(o, postscale)
        return outs

    return kernel


def _grouped_allreduce(tensors, name=None, op=Sum, prescale_factor=1.0,
                       postscale_factor=1.0, ignore_name_scope=False,
                       process_set=global_process_set):
    """Horovod's raw grouped allreduce op on dense tensors, differentiable."""
    xs = [_buf.as_tensor(t) for t in tensors]
    for x in xs:
        _buf.reducible(x, "grouped_allreduce", op)
        _buf.scalable(x, prescale_factor, "prescale_factor")
        _buf.scalable(x, postscale_factor, "postscale_factor")
    if not tf.executing_eagerly():
        _where(process_set)
    node = _node_name("GroupedAllreduce", name, xs[0])
    def forward(*xs):
        lib = _compiled(process_set)
        if lib is not None:
            return lib.hvd_grouped_allreduce(list(xs), reduce_op=op.name,
                                             prescale_factor=prescale_factor,
                                             postscale_factor=postscale_factor, name=node)
        made = []
        kernel = _grouped_kernel(op, prescale_factor, postscale_factor, process_set, name,
                                 made)
        outs = _buf.run(kernel, xs, [x.dtype for x in xs], [x.shape for x in xs], node,
                        aligned=True)
        if not tf.executing_eagerly():
            made.append(outs[0].op.name)
        return outs

    def grad(ys, *dys):
        return _grouped_allreduce(list(dys), op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, process_set=process_set)

    if not all(x.dtype.is_floating for x in xs):
        return forward(*xs)
    return _buf.differentiable(forward, xs, grad)


def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='',
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Returns the reductions of ``tensors`` (default: the averages), reduced as one fused
    op: every tensor is handed to the engine before any is waited for. ``IndexedSlices``
    among them are allgathered as ``allreduce`` does. Differentiable."""
    if not tensors:
        return tensors
    op = _op_of(average, op)
    out = [None] * len(tensors)
    dense = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _sparse_allreduce(t, op, prescale_factor, postscale_factor, process_set,
                                       ignore_name_scope)
        else:
            dense.append(i)
    if dense:
        xs = [_buf.as_tensor(tensors[i]) for i in dense]
        wires, ctxs = zip(*[compression.compress(x) for x in xs])
        reduced = _grouped_allreduce(list(wires), name=name, op=op,
                                     prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor,
                                     ignore_name_scope=ignore_name_scope,
                                     process_set=process_set)
        for i, x, r, ctx in zip(dense, xs, reduced, ctxs):
            out[i] = _buf.on_device_of(x, compression.decompress(r, ctx))
    return out


def _gathered(array, process_set):
    wire, back = _buf.native(array)
    return back(_arrays.allgather(wire, process_set))


def _allgather_grad(x, dy, process_set):
    """Horovod's allgather gradient: the average of ``dy`` across the ranks, this rank's
    rows of it."""

    def kernel(a, g):
        g = _reduced(g, Average, 1.0, 1.0, process_set)
        counts = _arrays.gather_counts(_arrays.rows(a.shape)[0], process_set)
        _, k, _ = _where(process_set)
        start = sum(counts[:k])
        return [g[start:start + counts[k]].reshape(a.shape)]

    return _buf.run(kernel, [x, dy], [dy.dtype], [x.shape], "HorovodAllgatherGrad")[0]


def _moved(kind, tensor, name, process_set, kernel, shape, grad):
    """A collective that moves ``tensor``'s elements (any fixed-size type) by ``kernel``
    into an output of static ``shape``; differentiable by ``grad(x, ys, dy)`` for floats."""
    x = _buf.as_tensor(tensor)
    _buf.movable(x, kind.lower())
    if not tf.executing_eagerly():
        _where(process_set)
    node = _node_name(kind, name, x)

    def forward(x):
        return _buf.run(kernel, [x], [x.dtype], [shape], node)

    if not x.dtype.is_floating:
        return _buf.on_device_of(x, forward(x)[0])
    out = _buf.differentiable(forward, [x], lambda ys, dy: grad(x, ys, dy))[0]
    return _buf.on_device_of(x, out)


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenates every rank's ``tensor`` along its first dimension, in rank order (of
    ``process_set``'s ranks); the first dimension may differ between ranks, the others may
    not. Differentiable as Horovod's: the gradient is this rank's rows of the averaged
    gradient."""
    return _moved("Allgather", tensor, name, process_set,
                  lambda a: [_gathered(a, process_set)], _rest(getattr(tensor, "shape", None)),
                  lambda x, ys, dy: _allgather_grad(x, dy, process_set))


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """``allgather`` of each of ``tensors``."""
    return [allgather(t, ignore_name_scope=ignore_name_scope, process_set=process_set)
            for t in tensors]


def _broadcast_kernel(root_rank, process_set):
    def kernel(a):
        wire, back = _buf.native(a)
        out = _buf.aligned_copy(wire)[0] if rank() == root_rank else \
            _arrays.empty(wire.shape, wire.dtype)
        _arrays.broadcast_(out, root_rank, process_set)
        return [back(out)]

    return kernel


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Returns ``root_rank``'s ``tensor`` (``root_rank`` a rank of the whole job) on every
    rank (of ``process_set``). Differentiable as Horovod's: the root's gradient is the
    average of the ranks' gradients, the others' zero."""

    def grad(x, ys, dy):
        g = _allreduce(dy, op=Average, process_set=process_set)
        return g if rank() == root_rank else g * 0

    return _moved("Broadcast", tensor, name, process_set,
                  _broadcast_kernel(root_rank, process_set), getattr(tensor, "shape", None),
                  grad)


def _alltoall_kernel(process_set, has_splits):
    def kernel(a, *splits):
        wire, back = _buf.native(a)
        out, received = _arrays.alltoall(wire, splits[0] if has_splits else None, process_set)
        return [back(out), _np.array(received, dtype=_np.int32)]

    return kernel


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Sends ``splits[p]`` rows (first-dimension slices) of ``tensor`` to rank ``p`` (equal
    parts without ``splits``). Returns, as Horovod's TensorFlow API does, what every rank
    sent here in rank order, and with ``splits`` given also the rows received from each
    rank (int32). Differentiable: the gradient goes back by the alltoall that reverses
    it."""
    x = _buf.as_tensor(tensor)
    _buf.movable(x, "alltoall")
    _, _, n = _where(process_set)
    node = _node_name("Alltoall", name, x)
    static = splits if not isinstance(splits, (tf.Tensor, tf.Variable)) else \
        tf.get_static_value(splits)
    if x.shape.rank and x.shape[0] is not None and (splits is None or static is not None):
        _arrays.splits_of(static, x.shape[0], n)  # a clear error before any rank waits
    inputs = [x]
    if splits is not None:
        inputs.append(tf.cast(_buf.as_tensor(splits), tf.int64))
    kernel = _alltoall_kernel(process_set, splits is not None)

    def forward(x, *s):
        return _buf.run(kernel, [x] + list(s), [x.dtype, tf.int32], [_rest(x.shape), [n]],
                        node)

    def grad(ys, dy, _):
        back = alltoall(dy, splits=ys[1], process_set=process_set)[0]
        return [back] + [None] * (len(inputs) - 1)

    if x.dtype.is_floating:
        out, received = _buf.differentiable(forward, inputs, grad)
    else:
        out, received = forward(*inputs)
    out = _buf.on_device_of(x, out)
    return (out, received) if splits is not None else out


def _reducescatter(tensor, name=None, op=Sum, ignore_name_scope=False,
                   process_set=global_process_set, prescale_factor=1.0,
                   postscale_factor=1.0):
    """Horovod's raw reducescatter op (default: the sum), differentiable."""
    if op is Adasum:
        raise ValueError("reducescatter reduces with hvd.Sum, Average, Min, Max or Product: "
                         "Adasum is an allreduce only")
    x = _buf.as_tensor(tensor)
    _buf.reducible(x, "reducescatter", op)
    _buf.scalable(x, prescale_factor, "prescale_factor")
    _buf.scalable(x, postscale_factor, "postscale_factor")
    if x.shape.rank == 0:
        raise ValueError("reducescatter of a 0-dimensional tensor: it has no rows to scatter")
    _, _, n = _where(process_set)
    node = _node_name("Reducescatter", name, x)

    def kernel(a):
        if prescale_factor != 1.0:
            a = _np.array(a, copy=True, order="C")
            _scale(a, prescale_factor)
        out = _arrays.reducescatter(a, op.name, process_set)
        _scale(out, postscale_factor)
        return [out]

    def forward(x):
        return _buf.run(kernel, [x], [x.dtype], [_rest(x.shape)], node)

    def grad(ys, dy):
        factor = (n if op is Sum else 1) * prescale_factor * postscale_factor
        return _gathered_tensor(dy * tf.cast(factor, dy.dtype) if factor != 1 else dy,
                                process_set)

    if not x.dtype.is_floating:
        return forward(x)[0]
    return _buf.differentiable(forward, [x], grad)[0]


def _gathered_tensor(x, process_set):
    return _buf.run(lambda a: [_gathered(a, process_set)], [x], [x.dtype], [_rest(x.shape)],
                    "HorovodReducescatterGrad")[0]


def reducescatter(tensor, device_dense='', compression=Compression.none, op=Average,
                  name=None, process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` across ranks (default: the average) and returns this rank's rows
    of the result; the first ``rows % size`` ranks get one row more (Horovod's split).
    Differentiable as Horovod's."""
    return _compressed(_reducescatter, tensor, compression, name=name, op=_op_of(None, op),
                       process_set=process_set, prescale_factor=prescale_factor,
                       postscale_factor=postscale_factor)


def grouped_reducescatter(tensors, device_dense='', compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """``reducescatter`` of each of ``tensors``."""
    return [reducescatter(t, compression=compression, op=op, process_set=process_set,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor)
            for t in tensors]


def _join_kernel():
    last = _hvd.join()
    # Every rank is past the join: generated names start afresh alike.
    _unnamed.clear()
    return [_np.array(last, dtype=_np.int32)]


def join():
    """Declares that this rank has run out of data and waits until every rank has; until
    then it takes part in the other ranks' allreduces with zeros. Returns the rank that
    joined last (an int32 scalar tensor)."""
    return _buf.run(_join_kernel, [], [tf.int32], [[]], "HorovodJoin")[0]


def barrier(process_set=global_process_set):
    """Waits until every rank (of ``process_set``) has called it. Inside ``tf.function`` it
    returns a tensor to order other work after."""
    def kernel():
        sid, _, _ = _where(process_set)
        _hvd.barrier(sid)
        return [_np.array(0, dtype=_np.int32)]

    out = _buf.run(kernel, [], [tf.int32], [[]], "HorovodBarrier")[0]
    return None if tf.executing_eagerly() else out


def _broadcast_group_kernel(root_rank, process_set):
    """Broadcasts a list of arrays from ``root_rank``: on the whole job every one is in
    flight in the background engine before any is waited for."""

    def kernel(*arrays):
        root = rank() == root_rank
        wires, backs = zip(*[_buf.native(a) for a in arrays]) if arrays else ((), ())
        # ``require`` keeps a 0-d array's shape (``ascontiguousarray`` makes it 1-d).
        outs = [_np.require(w, requirements="C") if root else _arrays.empty(w.shape, w.dtype)
                for w in wires]
        if _sid(process_set) is None:
            base = _name("broadcast_variables", None)
            pending = [_hvd.broadcast_async_(_arrays.address(o), o.size, _buf.name_of(o),
                                             root_rank, f"{base}.{i}", o)
                       for i, o in enumerate(outs)]
            for p in pending:
                p.wait()
        else:
            for o in outs:
                _arrays.broadcast_(o, root_rank, process_set)
        return [b(o) for b, o in zip(backs, outs)]

    return kernel


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assigns ``root_rank``'s values of ``variables`` to them on every rank (of
    ``process_set``), all broadcast as one fused op. The root's variables are sent from
    their own memory and left as they are; the others are assigned what arrived.
    ``inplace`` is accepted for Horovod's signature. Inside ``tf.function`` it returns the
    op that assigns them."""
    del inplace
    variables = list(variables)
    if not variables:
        return None
    current = [_buf.as_tensor(v) for v in variables]
    for c in current:
        _buf.movable(c, "broadcast_variables")
    kernel = _broadcast_group_kernel(root_rank, process_set)
    if tf.executing_eagerly():
        values = _buf.run(kernel, current, None, None, None)
        if rank() != root_rank:
            for v, value in zip(variables, values):
                v.assign(value)
        return None
    values = _buf.run(kernel, current, [c.dtype for c in current], [c.shape for c in current],
                      "HorovodBroadcastVariables")
    return tf.group(*[v.assign(value) for v, value in zip(variables, values)])


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Horovod's in-place broadcast of ``variables`` from ``root_rank``: here
    ``broadcast_variables`` (one fused op; the receiving ranks' variables are assigned what
    arrived). Returns the variables' new values."""
    variables = list(variables)
    done = broadcast_variables(variables, root_rank, process_set=process_set)
    with tf.control_dependencies([done] if done is not None else []):
        return [_buf.as_tensor(v) for v in variables]


def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=global_process_set):
    """Returns ``root_rank``'s ``obj`` (any picklable object) on every rank (of
    ``process_set``). ``session`` and ``name`` are accepted for Horovod's signature."""
    return _arrays.broadcast_object(obj, root_rank, process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Returns every rank's ``obj`` (any picklable object), in rank order."""
    return _arrays.allgather_object(obj, process_set)


def _value_op(value):
    return _buf.run(lambda: [_np.array(value(), dtype=_np.int32)], [], [tf.int32], [[]],
                    "HorovodTopology")[0]


def size_op(process_set_id=0, name=None):
    """The number of ranks (of process set ``process_set_id``), read when the graph runs."""
    def value():
        if not process_set_id:
            return size()
        return len(dict(_hvd.process_sets())[process_set_id])

    return _value_op(value)


def rank_op(name=None):
    """This rank, read when the graph runs."""
    return _value_op(rank)


def local_rank_op(name=None):
    """This rank among those on its host, read when the graph runs."""
    return _value_op(local_rank)


def local_size_op(name=None):
    """The number of ranks on this host, read when the graph runs."""
    return _value_op(local_size)


def gloo_enabled():
    """True: hvd's own transport plays Gloo's role."""
    return True


def ccl_built():
    """False: no oneCCL in this build."""
    return False


def ddl_built():
    """False: no IBM DDL in this build."""
    return False


def cuda_built():
    """False: hvd's collectives run in host memory."""
    return False


def rocm_built():
    """False: hvd's collectives run in host memory."""
    return False


def mpi_threads_supported():
    """False: hvd runs without MPI."""
    return False


def start_timeline(file_path, mark_cycles=False):
    """Starts recording this rank's engine activity into ``file_path`` (a Chrome trace)."""
    _hvd.start_timeline(str(file_path), bool(mark_cycles))


def stop_timeline():
    """Stops recording the timeline; what was recorded stays in the file."""
    _hvd.stop_timeline()


__all__ = [
    "Adasum", "Average", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "Product", "ProcessSet", "Sum", "add_process_set", "allgather", "allgather_object",
    "allreduce", "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_object",
    "broadcast_variables",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
    "gloo_enabled", "global_process_set", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rank_op", "reducescatter",
    "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline",
    "stop_timeline",
]
