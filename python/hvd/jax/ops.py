"""The collectives of ``hvd.jax`` on ``jax.Array``s and whole pytrees, eager and inside
``jax.jit``.

Eager, an array reaches the native module without a copy: a CPU ``jax.Array`` lends its
buffer (through DLPack, or as a read-only numpy view). A reduction's result is written into a
new aligned buffer (the one copy left: JAX arrays are immutable, so the input is copied into
the output and reduced there in place), which jaxlib takes over through DLPack without a
copy. The common call, one CPU array of the whole job, is one native call from DLPack to
DLPack. A pytree is reduced as one fused op of the background engine: every leaf is
submitted before any is waited for.

Inside ``jax.jit`` a collective is an ordered ``io_callback``: the compiled step calls back
into Python on the host, in program order on every rank, and the callback runs the eager
collective on the leaves' host buffers. Reductions are differentiable (Horovod's gradients:
an allreduce's is the same allreduce of the output's gradient). An hvd error in a callback
ends the compiled call with JAX's ``JaxRuntimeError``, which ``hvd.elastic.run`` takes for the
hvd error it carries.
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as _np
from jax.experimental import io_callback as _io_callback

from hvd import _hvd
from hvd import elastic as _elastic
from hvd._hvd import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from hvd.common import arrays as _arrays
from hvd.common.basics import *  # noqa: F401,F403
from hvd.common.basics import __all__ as _basics_all
from hvd.common.basics import _op_of, _where
from hvd.common.handles import _name, _unnamed

# The element types the native module reduces; others are only moved (as bytes).
_REDUCIBLE = {"uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"}

# jaxlib's own import of a DLPack tensor, which ``jax.dlpack.from_dlpack`` wraps in layers of
# checks and placement that cost 30-40 us a call (of a 4-byte allreduce's 40) where this
# costs 6; the public path is taken where it is missing or its signature differs.
try:
    from jax._src.lib import _jax as _jaxlib
    from jax._src.lib import jaxlib_extension_version as _jaxlib_version
    _import_dlpack = getattr(_jaxlib, "dlpack_managed_tensor_to_buffer", None)
except ImportError:  # pragma: no cover (another jaxlib layout)
    _import_dlpack, _jaxlib_version = None, 0
_KDL_CPU = 1


_LEAF = jax.tree_util.tree_structure(0)


def _leaves(tree):
    """The leaves of ``tree`` and its structure."""
    return jax.tree_util.tree_flatten(tree)


_Tracer = jax.core.Tracer


def _is_traced(x):
    return isinstance(x, _Tracer)


def _host(x, what):
    """``x`` (a ``jax.Array``, numpy array or scalar) as a C-contiguous numpy array on the
    host: a CPU array's own buffer, read-only. An array split across processes (a global
    ``jax.distributed`` array) is refused: each process holds only its part."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError(
            f"hvd.jax.{what}: the array spans processes (jax.distributed's global arrays); "
            f"pass each process's local array instead")
    # A multi-device array of this process is assembled whole, so the collective sees the
    # same values whatever its sharding.
    a = _np.asarray(x)
    return a if a.flags.c_contiguous else _np.ascontiguousarray(a)


# numpy's ``dtype.name`` builds its string on every call (3 us with ml_dtypes loaded).
_NAME_OF = {_np.dtype(jnp.dtype(n)): n for n in _REDUCIBLE}


def _dtype_name(array):
    return _NAME_OF.get(array.dtype) or array.dtype.name


def _scalable(dtype, factors):
    """A clear error for a scale factor on arrays that are not floating point (an integer
    array would silently truncate it)."""
    for which, factor in factors:
        if factor != 1.0 and not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{which} applies to floating-point arrays, not "
                             f"{_np.dtype(dtype).name}")


def _reducible(array, what, op):
    """A clear error before any rank waits when ``array``'s type cannot be reduced."""
    name = _dtype_name(array)
    if name not in _REDUCIBLE:
        raise ValueError(
            f"hvd.jax.{what} does not reduce arrays of dtype {name}: use uint8, int32, int64, "
            f"float16, bfloat16, float32 or float64 (cast first)")
    if op is Adasum and not _np.issubdtype(array.dtype, _np.floating) and name != "bfloat16":
        raise ValueError(f"hvd.Adasum combines floating-point arrays, not {name}")


def _adopt(capsule, device):
    """The DLPack ``capsule`` of host memory as a ``jax.Array`` on the CPU ``device``, without
    a copy, through jaxlib's own import."""
    if _jaxlib_version >= 467:
        return _import_dlpack(capsule, device, None, False, _KDL_CPU)
    return _import_dlpack(capsule, device, None, False)


def _adopted(out, device):
    """A ``jax.Array`` on the CPU ``device`` over the host buffer ``out``, without a copy
    (None where jaxlib cannot take it so: a type DLPack has no code for, such as bfloat16)."""
    if _import_dlpack is None:
        return None
    try:
        return _adopt(out.__dlpack__(), device)
    except (BufferError, TypeError, ValueError, RuntimeError):
        return None


def _allreduced(x, op):
    """The common eager call, a CPU array of the whole job reduced in one native call from
    DLPack to DLPack (the input read where it lies, the result written once into memory JAX
    takes over); None, with nothing sent, for what takes the general way (another device, a
    type hvd does not reduce, a jaxlib without the import)."""
    if _import_dlpack is None:
        return None
    devices = x.sharding.device_set
    if len(devices) != 1:
        return None
    (device,) = devices
    if device.platform != "cpu":
        return None
    capsule = _hvd.allreduced(x.__dlpack__(), op.name)
    if capsule is None:
        return None
    # JAX exported the input, so it takes the same type back.
    return _adopt(capsule, device)


def _like(out, x):
    """The host result ``out`` as a ``jax.Array`` placed as ``x`` is (without a copy on CPU,
    through DLPack); numpy in, numpy out."""
    if not isinstance(x, jax.Array):
        return out
    devices = x.sharding.device_set
    if len(devices) == 1:
        (device,) = devices
        if device.platform == "cpu":
            y = _adopted(out, device)
            if y is not None:
                return y
    try:
        y = jax.dlpack.from_dlpack(out)
    except (BufferError, TypeError, ValueError, RuntimeError):  # bfloat16 has no DLPack: a copy
        y = jnp.asarray(out)
    return jax.device_put(y, x.sharding)


def _scale(array, factor):
    if factor != 1.0:
        array *= array.dtype.type(factor)


def _sid(process_set):
    if process_set is None or process_set is global_process_set:
        return None
    return _where(process_set)[0]


def _reduce_arrays(arrays, op, prescale, postscale, process_set, name):
    """Reduced copies of the host arrays ``arrays``: one fused op of the engine on the whole
    job (all submitted before any is waited for), one after another on a process set."""
    outs = []
    for a in arrays:
        out, at = _arrays.aligned(a.shape, a.dtype, a.nbytes)
        out[...] = a
        _scale(out, prescale)
        outs.append((out, at))
    sid = _sid(process_set)
    if len(outs) == 1 and sid is None and name is None:
        out, at = outs[0]
        _hvd.allreduce_(at, out.size, _dtype_name(out), op.name)
    elif sid is None:
        base = _name("jax.allreduce", name)
        pending = [_hvd.allreduce_async_(at, o.size, _dtype_name(o), op.name, f"{base}.{i}", o)
                   for i, (o, at) in enumerate(outs)]
        for p in pending:
            p.wait()
    else:
        for o, at in outs:
            _hvd.allreduce_on_(sid, at, o.size, _dtype_name(o), op.name)
    for o, _ in outs:
        _scale(o, postscale)
    return [o for o, _ in outs]


def _signature(arrays, treedef):
    """A digest of a pytree's structure, shapes and element types, the same on every rank
    that passes the same pytree."""
    text = repr(treedef) + "".join(f"|{a.dtype.name}{tuple(a.shape)}" for a in arrays)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _agree(arrays, treedef, what, process_set):
    """Raises the same clear error on every rank (of ``process_set``) when their pytrees
    differ in structure, shapes or element types: a rank that submitted a leaf the others
    never will would otherwise wait for it."""
    mine = _signature(arrays, treedef)
    all_ = _arrays.gather_counts(mine, process_set)
    if len(set(all_)) > 1:
        _, _, n = _where(process_set)
        groups = {}
        for r, s in enumerate(all_):
            groups.setdefault(s, []).append(r)
        parts = "; ".join(f"ranks {rs}" for rs in groups.values())
        raise ValueError(
            f"hvd.jax.{what}: the ranks passed different pytrees (structure, shapes or dtypes "
            f"differ between {parts} of {n}); this rank's: {treedef} with "
            f"{[(a.dtype.name, tuple(a.shape)) for a in arrays]}")


# hvd's errors raised by a callback inside a compiled program, which JAX reports as a
# ``JaxRuntimeError`` naming them only in its text: kept here for ``hvd.elastic.run``.
_raised = []


def _hvd_error_of(e):
    """The hvd error a callback raised that ended the compiled program with ``e``."""
    if isinstance(e, jax.errors.JaxRuntimeError) and _raised:
        out = _raised[-1]
        _raised.clear()
        return out
    return None


_elastic.register_error_translator(_hvd_error_of)


def _callback(host_fn, xs, shapes):
    """``host_fn`` on the host values of the traced ``xs``, as an ordered callback of the
    compiled program: every rank runs its collectives in the same order."""

    def guarded(*arrays):
        try:
            return host_fn(*arrays)
        except (HorovodInternalError, HostsUpdatedInterrupt) as e:
            _raised.append(e)
            raise

    return _io_callback(guarded, shapes, *xs, ordered=True)


def _structs(xs):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]


def _allreduce_leaves(xs, op, prescale, postscale, process_set, name, what, check):
    """The reduced leaves ``xs`` (eager or traced), as one fused op."""
    scales = (("prescale_factor", prescale), ("postscale_factor", postscale))
    for x in xs:
        _scalable(x.dtype, scales)
    if any(_is_traced(x) for x in xs):
        for x in xs:
            _reducible(_np.empty(0, x.dtype), what, op)

        def host(*arrays):
            arrays = [_arrays.contiguous(_np.asarray(a)) for a in arrays]
            return _reduce_arrays(arrays, op, prescale, postscale, process_set, name)

        return list(_differentiable_callback(host, xs, op, prescale, postscale, process_set))
    arrays = [_host(x, what) for x in xs]
    for a in arrays:
        _reducible(a, what, op)
    if check is not None:
        _agree(arrays, check, what, process_set)
    outs = _reduce_arrays(arrays, op, prescale, postscale, process_set, name)
    return [_like(o, x) for o, x in zip(outs, xs)]


def _differentiable_callback(host, xs, op, prescale, postscale, process_set):
    """The callback of a reduction inside a trace, with Horovod's gradient: the same
    reduction of the output's gradient (Sum and Average; others are not differentiable)."""
    xs = list(xs)
    if op not in (Sum, Average) or not all(
            jnp.issubdtype(x.dtype, jnp.floating) for x in xs):
        return _callback(host, xs, _structs(xs))

    @jax.custom_vjp
    def reduce(*args):
        return tuple(_callback(host, list(args), _structs(args)))

    def fwd(*args):
        return reduce(*args), None

    def bwd(_, grads):
        return tuple(_allreduce_leaves(list(grads), op, prescale, postscale, process_set,
                                       None, "allreduce", None))

    reduce.defvjp(fwd, bwd)
    return reduce(*xs)


def allreduce(tensor, average=None, device_dense='', device_sparse='', compression=None,
              op=None, prescale_factor=1.0, postscale_factor=1.0, name=None,
              process_set=global_process_set):
    """Returns the reduction of ``tensor`` across all ranks or ``process_set``'s (default:
    the average): a ``jax.Array``, a numpy array, or a whole pytree of them, reduced as one
    fused op. Works eagerly and inside ``jax.jit``. ``device_*`` and ``compression`` are
    accepted for Horovod's signature: hvd reduces in host memory, uncompressed."""
    del device_dense, device_sparse, compression
    op = _op_of(average, op)
    if isinstance(tensor, jax.Array) and not _is_traced(tensor):
        # Adasum takes the general way, which refuses integers before anything is sent.
        if (process_set is global_process_set or process_set is None) and name is None and \
                prescale_factor == 1.0 and postscale_factor == 1.0 and op is not Adasum:
            out = _allreduced(tensor, op)
            if out is not None:
                return out
        return _allreduce_leaves([tensor], op, prescale_factor, postscale_factor, process_set,
                                 name, "allreduce", None)[0]
    leaves, treedef = _leaves(tensor)
    if not leaves:
        return tensor
    single = treedef == _LEAF
    outs = _allreduce_leaves(leaves, op, prescale_factor, postscale_factor, process_set,
                             name, "allreduce", None if single else treedef)
    return jax.tree_util.tree_unflatten(treedef, outs)


def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='',
                      compression=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, name=None):
    """The reductions of ``tensors`` (a list, or any pytree), as one fused op: every array is
    handed to the engine before any is waited for."""
    del device_dense, device_sparse, compression
    op = _op_of(average, op)
    leaves, treedef = _leaves(tensors)
    if not leaves:
        return tensors
    outs = _allreduce_leaves(leaves, op, prescale_factor, postscale_factor, process_set,
                             name, "grouped_allreduce", treedef)
    return jax.tree_util.tree_unflatten(treedef, outs)


def _wire(array):
    """``array`` as the native module moves it: itself when its type is one the module
    knows, else its bytes (rows of bytes along the first dimension); and the way back."""
    if _dtype_name(array) in _REDUCIBLE:
        return array, lambda out: out
    dtype, rest = array.dtype, array.shape[1:]
    lead = array.shape[:1] or (1,)
    wire = array.reshape(lead + (-1,)).view(_np.uint8) if array.size else \
        _np.empty(lead + (0,), _np.uint8)

    def back(out):
        shaped = out.view(dtype).reshape((out.shape[0],) + rest)
        return shaped if array.ndim else shaped.reshape(())

    return wire, back


def _moved(what, tensor, host_fn, shape_of):
    """A collective that moves each leaf of ``tensor`` by ``host_fn(host array) -> host
    array``; ``shape_of(x)`` gives the output's shape inside a trace."""
    leaves, treedef = _leaves(tensor)
    outs = []
    for x in leaves:
        if _is_traced(x):
            struct = jax.ShapeDtypeStruct(shape_of(x), x.dtype)
            outs.append(_callback(lambda a: host_fn(_arrays.contiguous(_np.asarray(a))),
                                  [x], struct))
        else:
            outs.append(_like(host_fn(_host(x, what)), x))
    return jax.tree_util.tree_unflatten(treedef, outs)


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's ``tensor`` (each leaf of a pytree) along its first
    dimension, in rank order (of ``process_set``'s ranks); the first dimension may differ
    between ranks eagerly, inside ``jax.jit`` every rank must pass as many rows."""

    def host(a):
        wire, back = _wire(a)
        return back(_arrays.allgather(wire, process_set))

    def shape_of(x):
        # Traced, the output's shape must be known now: every rank passes as many rows.
        _, _, n = _where(process_set)
        if not x.shape:
            raise ValueError("hvd.jax.allgather of a 0-dimensional array: it has no rows")
        return (x.shape[0] * n,) + tuple(x.shape[1:])

    return _moved("allgather", tensor, host, shape_of)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``tensor`` (each leaf of a pytree; ``root_rank`` a rank of
    the whole job) on every rank (of ``process_set``)."""

    def host(a):
        wire, back = _wire(a)
        out = _arrays.empty(wire.shape, wire.dtype)
        if rank() == root_rank:
            out[...] = wire
        _arrays.broadcast_(out, root_rank, process_set)
        return back(out)

    return _moved("broadcast", tensor, host, lambda x: tuple(x.shape))


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends ``splits[p]`` rows (first-dimension slices) of ``tensor`` to rank ``p`` (equal
    parts without ``splits``); returns what every rank sent here, in rank order, and how many
    rows came from each. Eager only: the rows received depend on the other ranks."""
    if _is_traced(tensor) or _is_traced(splits):
        raise ValueError("hvd.jax.alltoall runs eagerly only: the rows it receives depend on "
                         "the other ranks, so its output has no shape to trace")
    array = _host(tensor, "alltoall")
    wire, back = _wire(array)
    out, received = _arrays.alltoall(wire, None if splits is None else _np.asarray(splits),
                                     process_set)
    return _like(back(out), tensor), jnp.asarray(received, dtype=jnp.int32)


def reducescatter(tensor, op=None, name=None, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` (each leaf of a pytree) across ranks (default: the average) and
    returns this rank's rows of the result; the first ``rows % size`` ranks get one row
    more."""
    op = Average if op is None else _op_of(None, op)
    if op is Adasum:
        raise ValueError("reducescatter reduces with hvd.Sum, Average, Min, Max or Product: "
                         "Adasum is an allreduce only")
    _, r, n = _where(process_set)

    def host(a):
        _reducible(a, "reducescatter", op)
        _scalable(a.dtype, (("prescale_factor", prescale_factor),
                            ("postscale_factor", postscale_factor)))
        a = a.copy() if prescale_factor != 1.0 else a
        _scale(a, prescale_factor)
        out = _arrays.reducescatter(a, op.name, process_set)
        out = _np.array(out)
        _scale(out, postscale_factor)
        return out

    def shape_of(x):
        if not x.shape:
            raise ValueError("reducescatter of a 0-dimensional array: it has no rows to "
                             "scatter")
        base, extra = divmod(x.shape[0], n)
        return (base + (1 if r < extra else 0),) + tuple(x.shape[1:])

    return _moved("reducescatter", tensor, host, shape_of)


def barrier(process_set=None):
    """Waits until every rank (of ``process_set``, if given) has called it."""
    sid, _, _ = _where(process_set)
    _hvd.barrier(sid)


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Returns ``root_rank``'s ``obj`` (any picklable object) on every rank."""
    return _arrays.broadcast_object(obj, root_rank, process_set)


def allgather_object(obj, name=None, process_set=None):
    """Returns every rank's ``obj`` (any picklable object), in rank order."""
    return _arrays.allgather_object(obj, process_set)


def broadcast_parameters(params, root_rank=0, process_set=global_process_set):
    """Returns ``params`` (any pytree of arrays: Flax's variables, an optax state) as
    ``root_rank`` holds them, on every rank. The ranks' pytrees must agree in structure,
    shapes and dtypes; a clear error on every rank says where they do not."""
    leaves, treedef = _leaves(params)
    if not leaves:
        return params
    if any(_is_traced(x) for x in leaves):
        return broadcast(params, root_rank, process_set=process_set)
    arrays = [_host(x, "broadcast_parameters") for x in leaves]
    _agree(arrays, treedef, "broadcast_parameters", process_set)
    outs = []
    for a, x in zip(arrays, leaves):
        wire, back = _wire(a)
        out = _arrays.empty(wire.shape, wire.dtype)
        if rank() == root_rank:
            out[...] = wire
        _arrays.broadcast_(out, root_rank, process_set)
        outs.append(_like(back(out), x))
    return jax.tree_util.tree_unflatten(treedef, outs)


def join(device=-1):
    """Declares that this rank has run out of data and waits until every rank has; meanwhile
    it takes part in the other ranks' allreduces with zeros. Returns the rank that joined
    last."""
    del device
    last = _hvd.join()
    # Every rank is past the join: generated names start afresh alike.
    _unnamed.clear()
    return last


__all__ = sorted(set(_basics_all) | {
    "HorovodInternalError", "HostsUpdatedInterrupt", "allgather", "allgather_object",
    "allreduce", "alltoall", "barrier", "broadcast", "broadcast_object",
    "broadcast_parameters", "grouped_allreduce", "join", "reducescatter",
})
