"""How TensorFlow tensors reach hvd's native collectives and come back.

A collective is written once as a *kernel*: a function from numpy arrays to numpy arrays
over ``hvd.common.arrays`` and the native module. ``run`` calls it on an eager tensor's own
memory, or, inside ``tf.function``, as a stateful ``tf.numpy_function`` node (TensorFlow
orders stateful nodes as the program wrote them, so every rank calls its collectives in
the same order). Whole-job allreduces inside ``tf.function`` are hvd's compiled op instead
where it can be built (``hvd.tensorflow.graph_ops``).

Copies, measured on TensorFlow 2.21 (CPU):

- the eager allreduce of a CPU tensor (``allreduced``) is one native call: the tensor goes in
  as TensorFlow's DLPack export of its buffer and comes back as a capsule over the memory the
  native module reduced a copy of its input in.

- in: none. ``EagerTensor._numpy()`` is a view of the tensor's buffer (``numpy()`` would
  copy it); a ``tf.numpy_function`` hands its kernel views of its inputs likewise. Kernels
  never write into them.
- out: none. A kernel's result array becomes a tensor through DLPack
  (``tf.experimental.dlpack.from_dlpack``), which keeps the array's memory; bfloat16, which
  DLPack does not carry, goes as its 16-bit pattern and a ``tf.bitcast``, which shares the
  buffer too. Inside ``tf.function``, ``numpy_function`` wraps the returned array without
  a copy as well. Outputs are allocated 64-byte aligned (``hvd.common.arrays.aligned``):
  TensorFlow's kernels abort on memory that Eigen's vectors cannot read, and
  ``numpy_function`` copies what is not aligned.
- an allreduce or broadcast copies its input once, into the output it reduces in place:
  TensorFlow's tensors are immutable, so the result needs memory of its own (Horovod's op
  allocates its output and copies into it as well).
- ``broadcast_variables`` assigns the received values to the variables (one copy on the
  receiving ranks; the root's variables are lent as they are).
- tensors on another device than the CPU are staged through host memory.
"""

import numpy as _np
import tensorflow as tf

from hvd import _hvd
from hvd._hvd import HorovodInternalError, HostsUpdatedInterrupt
from hvd.common import arrays as _arrays
from hvd.common.basics import Adasum

# The element types hvd's collectives reduce.
REDUCIBLE = ("uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
_REDUCIBLE_TF = frozenset(tf.as_dtype(n) for n in REDUCIBLE)
_REDUCIBLE_ENUMS = frozenset(d.as_datatype_enum for d in _REDUCIBLE_TF)
# numpy's ``dtype.name`` builds its string anew on every call: looked up here instead.
_NAMES = {_np.dtype(tf.as_dtype(n).as_numpy_dtype): n for n in REDUCIBLE}


def name_of(array):
    """The native module's name of ``array``'s element type (None if it has none)."""
    return _NAMES.get(array.dtype)


try:
    # Autograph leaves hvd alone, as it leaves TensorFlow and Keras: converting it would
    # only slow tracing, and kernels defined in converted code would run every call through
    # autograph's converter at run time.
    from tensorflow.python.autograph.core import config as _autograph_config

    _autograph_config.CONVERSION_RULES = (
        (_autograph_config.DoNotConvert("hvd"),) + tuple(_autograph_config.CONVERSION_RULES))
except (ImportError, AttributeError):  # pragma: no cover (a TensorFlow without these rules)
    pass

try:
    from tensorflow.python.eager import record as _record

    def _recording():
        return _record.could_possibly_record()
except ImportError:  # pragma: no cover (older TensorFlow)
    def _recording():
        return True


def reducible(tensor, what, op=None):
    """Raises a clear error unless hvd can reduce ``tensor``'s element type with ``op``."""
    dtype = tensor.dtype
    if dtype in _REDUCIBLE_TF and op is not Adasum:
        return
    dtype = tf.as_dtype(dtype)
    if dtype not in _REDUCIBLE_TF:
        raise TypeError(f"hvd.tensorflow.{what} cannot reduce tensors of dtype {dtype.name}: "
                        f"hvd reduces {', '.join(REDUCIBLE)}")
    if op is Adasum and not dtype.is_floating:
        raise TypeError(f"hvd.Adasum combines floating-point tensors, not {dtype.name}")


def movable(tensor, what):
    """Raises a clear error unless ``tensor``'s elements can be moved as bytes."""
    dtype = tf.as_dtype(tensor.dtype)
    if dtype in (tf.string, tf.resource, tf.variant):
        raise TypeError(f"hvd.tensorflow.{what} moves fixed-size elements, not {dtype.name}: "
                        f"use broadcast_object or allgather_object for such values")


def scalable(tensor, factor, which):
    """Raises a clear error for a scale factor on tensors that are not floating point."""
    if factor != 1.0 and not tf.as_dtype(tensor.dtype).is_floating:
        raise TypeError(f"{which} applies to floating-point tensors, not "
                        f"{tf.as_dtype(tensor.dtype).name}")


def as_tensor(value):
    """``value`` (a tensor, variable, array or number) as a tensor; variables are read."""
    if isinstance(value, tf.Tensor):
        return value
    return tf.convert_to_tensor(value)


def array_of(tensor):
    """An eager tensor's memory as a numpy array (its own buffer when on the CPU)."""
    try:
        return tensor._numpy()
    except AttributeError:
        return as_tensor(tensor)._numpy()


def aligned_copy(array):
    """A C-contiguous copy of ``array`` in memory TensorFlow's kernels can read in place, and
    its address."""
    out, at = _arrays.aligned(array.shape, array.dtype, array.nbytes)
    _np.copyto(out, array)
    return out, at


def tensor_of(array, aligned=False):
    """A numpy array as an eager tensor over the same memory (over a copy where it is not
    known to be ``aligned`` as TensorFlow's kernels require and is not)."""
    if not aligned and (not array.flags.c_contiguous
                        or _arrays.address(array) % _arrays.ALIGN):
        array = aligned_copy(array)[0]
    if _NAMES.get(array.dtype) == "bfloat16":
        bits = _from_dlpack(array.view(_np.uint16).__dlpack__())
        return tf.bitcast(bits, tf.bfloat16)
    try:
        return _from_dlpack(array.__dlpack__())
    except Exception:  # noqa: BLE001 (an element type DLPack lacks: copied)
        return tf.convert_to_tensor(array)


try:
    from tensorflow.python import pywrap_tfe as _tfe
    from tensorflow.python.eager import context as _context

    _to_dlpack = _tfe.TFE_ToDlpackCapsule

    def _from_dlpack(capsule):
        # ``tf.experimental.dlpack.from_dlpack`` without its Python layer.
        ctx = _context.context()
        ctx.ensure_initialized()
        return _tfe.TFE_FromDlpackCapsule(capsule, ctx._handle)
except (ImportError, AttributeError):  # pragma: no cover (a TensorFlow that moved them)
    _to_dlpack = tf.experimental.dlpack.to_dlpack
    _from_dlpack = tf.experimental.dlpack.from_dlpack


def allreduced(tensor, op):
    """The eager allreduce of a CPU ``EagerTensor`` in one native call: its memory read
    through DLPack, reduced in a copy that becomes the result through DLPack (no copy in
    or out); None, with nothing sent, where it takes the general way (a device other than
    the CPU, an element type DLPack or hvd lacks)."""
    # TensorFlow aborts the process on exporting what is not plain memory (strings): only
    # the element types hvd reduces are exported.
    if tensor._datatype_enum() not in _REDUCIBLE_ENUMS:
        return None
    out = _hvd.allreduced(_to_dlpack(tensor), op.name)
    return None if out is None else _from_dlpack(out)


def native(array):
    """``array`` as the native module takes it, and how to turn a result back: itself for the
    element types hvd knows, else its bytes (rows of them along the first dimension), for
    collectives that only move elements."""
    if array.dtype in _NAMES:
        return array, lambda out: out
    shape = array.shape
    count, row_len = _arrays.rows(shape)
    wire = _arrays.contiguous(array).reshape(count, row_len).view(_np.uint8)

    def back(out):
        return out.view(array.dtype).reshape((-1,) + tuple(shape[1:]))

    return wire, back


# The collective error a graph kernel raised last: TensorFlow wraps it in an OpError, and
# ``translate`` gives it back to ``hvd.elastic.run``.
_last_error = [None]


def _guarded(kernel):
    def run_kernel(*arrays):
        try:
            return kernel(*arrays)
        except (HorovodInternalError, HostsUpdatedInterrupt) as e:
            _last_error[0] = e
            raise

    return run_kernel


def translate(error):
    """The ``HorovodInternalError`` or ``HostsUpdatedInterrupt`` that a collective raised
    inside ``tf.function``, for the ``tf.errors.OpError`` TensorFlow wrapped it in; None for
    other errors."""
    if not isinstance(error, tf.errors.OpError):
        return None
    for cls in (HostsUpdatedInterrupt, HorovodInternalError):
        if cls.__name__ in (error.message or ""):
            last = _last_error[0]
            _last_error[0] = None
            return last if isinstance(last, cls) else cls(error.message)
    return None


def run(kernel, inputs, dtypes, shapes, name, aligned=False):
    """Runs ``kernel(*arrays) -> list of arrays`` on the tensors ``inputs``: directly when
    executing eagerly, else as a graph node named ``name`` whose outputs have ``dtypes`` and
    the static ``shapes`` known (None where unknown). Returns the output tensors. A kernel
    whose outputs are all ``aligned`` saves checking them."""
    if tf.executing_eagerly():
        outs = kernel(*[array_of(t) for t in inputs])
        return [tensor_of(o, aligned) for o in outs]
    outs = tf.numpy_function(_guarded(kernel), list(inputs), list(dtypes), stateful=True,
                             name=name)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    for o, s in zip(outs, shapes):
        if s is not None:
            o.set_shape(s)
    return list(outs)


def direct():
    """Whether a collective may run its kernel straight on eager tensors' memory and skip
    the graph and gradient bookkeeping: executing eagerly, with no tape recording."""
    return tf.executing_eagerly() and not _recording()


def differentiable(forward, inputs, grad):
    """``forward(*inputs)`` (a list of tensors) with ``grad(outputs, *output_grads)`` as its
    gradient where a tape or a graph may need one; eager calls that no tape records skip
    the bookkeeping."""
    if direct():
        return forward(*inputs)

    @tf.custom_gradient
    def op(*xs):
        ys = forward(*xs)

        def backward(*dys):
            dys = [tf.zeros_like(y) if d is None else d for y, d in zip(ys, dys)]
            return grad(ys, *dys)

        return ys, backward

    return list(op(*inputs))


def on_device_of(tensor, out):
    """``out`` moved to ``tensor``'s device when that is not the CPU."""
    device = getattr(tensor, "device", "") or ""
    if "GPU" in device.upper():
        with tf.device(device):
            return tf.identity(out)
    return out
