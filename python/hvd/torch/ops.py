"""The collectives of ``hvd.torch``, over hvd's native module.

Tensors go to the collectives without a copy when they are contiguous CPU
tensors; others are made contiguous (and CUDA tensors staged through host
memory), reduced, and copied back. Every call that waits on other ranks
releases the GIL.
"""

import torch as _torch

from hvd import _hvd
from hvd._hvd import HorovodInternalError, HostsUpdatedInterrupt
from hvd.torch.compression import Compression


from hvd.common import arrays as _arrays
from hvd.common.basics import *  # noqa: F401,F403
from hvd.common.basics import _Op, _op_of, _set_id, _where  # noqa: F401
from hvd.common.handles import _Done, _handle, _handles, _name, _ran, _unnamed, poll, synchronize  # noqa: F401


def _dtype_name(tensor):
    return str(tensor.dtype).replace("torch.", "")


def _tensor(tensor):
    if not isinstance(tensor, _torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def _in_place(tensor, run):
    """Runs ``run(address, count, dtype)`` on ``tensor``'s memory, staging it through a
    contiguous CPU copy when it is not one already."""
    _tensor(tensor)
    direct = tensor.device.type == "cpu" and tensor.is_contiguous()
    work = tensor if direct else tensor.detach().to("cpu").contiguous()
    # ``work`` is referenced by this frame until ``run`` returns: its memory stays allocated.
    run(work.data_ptr(), work.numel(), _dtype_name(work))
    if direct:
        _written(tensor)
    else:
        with _torch.no_grad():
            tensor.copy_(work)
    return tensor


def _written(tensor):
    """Tells PyTorch that ``tensor`` was written in place behind its back (by the native
    collectives), as an in-place operator would: its version counter moves, so autograd
    sees the write (and refuses a backward through a value it overwrote)."""
    _torch.autograd.graph.increment_version(tensor)


def _check_op(tensor, op):
    """Adasum combines floating-point tensors only: said before any rank waits on a peer."""
    if op is Adasum and not _tensor(tensor).is_floating_point():
        raise ValueError(f"hvd.Adasum combines floating-point tensors, not {tensor.dtype}")


def _scale(tensor, factor, which):
    if factor == 1.0:
        return
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{which} applies to floating-point tensors, not {tensor.dtype}")
    with _torch.no_grad():
        tensor.mul_(factor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """Reduces ``tensor`` across all ranks (or ``process_set``'s) in place (default: the
    average) and returns it."""
    op = _op_of(average, op)
    _check_op(tensor, op)
    sid = _set_id(process_set)
    _scale(tensor, prescale_factor, "prescale_factor")
    if sid is None:
        _in_place(tensor, lambda a, n, d: _hvd.allreduce_(a, n, d, op.name))
    else:
        _in_place(tensor, lambda a, n, d: _hvd.allreduce_on_(sid, a, n, d, op.name))
    _scale(tensor, postscale_factor, "postscale_factor")
    return tensor


class _Allreduce(_torch.autograd.Function):
    """An allreduce that autograd differentiates: its gradient is the same allreduce of the
    output's gradient (as in Horovod)."""

    @staticmethod
    def forward(ctx, tensor, op, compression, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        wire, cctx = compression.compress(tensor.detach().clone())
        out = allreduce_(wire, op=op, prescale_factor=prescale, postscale_factor=postscale,
                         process_set=process_set)
        return compression.decompress(out, cctx)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        g = allreduce_(grad.detach().clone().contiguous(), op=op, prescale_factor=prescale,
                       postscale_factor=postscale, process_set=process_set)
        return g, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Returns the reduction of ``tensor`` across all ranks or ``process_set``'s (default:
    the average), sent as ``compression`` says; the input is left as it was. Autograd
    differentiates it: the gradient is the same allreduce of the output's gradient."""
    op = _op_of(average, op)
    _tensor(tensor)
    if tensor.requires_grad and _torch.is_grad_enabled():
        return _Allreduce.apply(tensor, op, compression, prescale_factor, postscale_factor,
                                process_set)
    wire, ctx = compression.compress(tensor.detach().clone())
    out = allreduce_(wire, op=op, prescale_factor=prescale_factor,
                     postscale_factor=postscale_factor, process_set=process_set)
    return compression.decompress(out, ctx)


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Copies ``tensor`` from ``root_rank`` (a global rank) to every rank (of
    ``process_set``), in place, and returns it."""
    sid = _set_id(process_set)
    if sid is None:
        return _in_place(tensor, lambda a, n, d: _hvd.broadcast_(a, n, d, root_rank))
    return _in_place(tensor, lambda a, n, d: _hvd.broadcast_on_(sid, a, n, d, root_rank))


def broadcast(tensor, root_rank, name=None, process_set=None):
    """Returns ``root_rank``'s ``tensor`` on every rank; the input is left as it was."""
    return broadcast_(_tensor(tensor).detach().clone(), root_rank, name=name,
                      process_set=process_set)


def broadcast_parameters(params, root_rank):
    """Copies parameters (a ``state_dict()`` or ``named_parameters()``) from ``root_rank``
    to every rank, in place; all in flight together, each op named after its parameter."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    named = [(f"broadcast_parameters.{k}", p.data if p.requires_grad else p) for k, p in items
             if isinstance(p, _torch.Tensor)]
    _broadcast_all(named, root_rank)


def _broadcast_all(named, root_rank):
    """Broadcasts the ``(name, tensor)`` pairs from ``root_rank`` in place, submitted
    together so the engine runs them back to back. The names come from what is broadcast,
    never from a count of earlier calls, so a worker that joined late agrees with the
    others."""
    with _torch.no_grad():
        handles = [broadcast_async_(t, root_rank, name=name) for name, t in named]
        for h in handles:
            synchronize(h)


def barrier(process_set=None):
    """Waits until every rank (of ``process_set``, if given) has called it."""
    sid, _, _ = _where(process_set)
    _hvd.barrier(sid)


def join(device=-1):
    """Declares that this rank has run out of data and waits until every rank has; until
    then it takes part in the other ranks' allreduces with zeros (``DistributedOptimizer``'s
    included), so ranks with uneven data finish together. Only allreduces can run while a
    rank is joined. Returns the rank that joined last. ``device`` is accepted for Horovod's
    signature: the zeros live in host memory."""
    del device
    last = _hvd.join()
    # Every rank is past the join: generated names start afresh alike.
    _unnamed.clear()
    return last


def start_timeline(file_path, mark_cycles=False):
    """Starts recording this rank's engine activity into ``file_path`` (a Chrome trace; every
    rank may name the same file)."""
    _hvd.start_timeline(str(file_path), bool(mark_cycles))


def stop_timeline():
    """Stops recording the timeline; what was recorded stays in the file."""
    _hvd.stop_timeline()


def _submit(tensor, submit, finish):
    """Lends ``tensor``'s memory to ``submit(address, count, dtype, owner)`` (a contiguous
    CPU copy when it is not one itself) and returns the handle; ``finish(tensor)`` runs when
    it is waited for."""
    _tensor(tensor)
    direct = tensor.device.type == "cpu" and tensor.is_contiguous()
    work = tensor if direct else tensor.detach().to("cpu").contiguous()
    native = submit(work.data_ptr(), work.numel(), _dtype_name(work), work)

    def complete():
        native.wait()
        if direct:
            _written(tensor)
        else:
            with _torch.no_grad():
                tensor.copy_(work)
        finish(tensor)
        return tensor

    return _handle(native, complete)


def _produced(native, rest, row_len, dtype, device):
    """What completes an op whose engine fills a buffer of its own (``native`` an
    ``OutputHandle``): waits, allocates the output (rows of ``row_len`` elements shaped
    ``rest``), copies the result in; returns it with the elements received from each rank
    (an alltoall's; empty otherwise)."""

    def complete():
        elements, counts = native.wait()
        out = _torch.empty((elements // max(row_len, 1),) + rest, dtype=dtype)
        native.copy_into(out.data_ptr(), out.numel(), _dtype_name(out))
        return out.to(device), counts

    return complete


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None):
    """Starts reducing ``tensor`` across all ranks in place; returns a handle for
    ``synchronize``/``poll``. The tensor must not be used until then. On a process set the
    op runs at once (the background engine serves the whole job)."""
    op = _op_of(average, op)
    _check_op(tensor, op)
    sid = _set_id(process_set)
    if sid is not None:
        allreduce_(tensor, op=op, prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, process_set=process_set)
        return _submit(tensor, lambda a, n, d, owner: _Done(), lambda t: None)
    _scale(tensor, prescale_factor, "prescale_factor")
    name = _name("allreduce", name)
    return _submit(
        tensor,
        lambda a, n, d, owner: _hvd.allreduce_async_(a, n, d, op.name, name, owner),
        lambda t: _scale(t, postscale_factor, "postscale_factor"))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None):
    """Starts reducing a copy of ``tensor``; ``synchronize`` returns the result."""
    return allreduce_async_(_tensor(tensor).detach().clone(), average=average, name=name,
                            op=op, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, process_set=process_set)


def _contiguous_cpu(tensor):
    _tensor(tensor)
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor
    return tensor.detach().to("cpu").contiguous()


def _as_array(tensor):
    """A contiguous CPU copy of ``tensor`` when it is not one already, as a numpy view of
    its memory and the dtype name the native module sees (numpy has no bfloat16: such a
    tensor is lent as its 16-bit pattern)."""
    t = _contiguous_cpu(tensor).detach()
    if t.dtype == _torch.bfloat16:
        return t.view(_torch.int16).numpy(), "bfloat16"
    return t.numpy(), None


def _from_array(array, like):
    """The numpy ``array`` returned by ``hvd.common.arrays`` as a tensor of ``like``'s dtype
    (sharing its memory), moved to ``like``'s device."""
    out = _torch.from_numpy(array)
    if like.dtype == _torch.bfloat16:
        out = out.view(_torch.bfloat16)
    return out.to(like.device)


def _rows(t):
    """``t`` as rows along its first dimension: (rows, elements per row)."""
    return _arrays.rows(tuple(t.shape))


def allgather(tensor, name=None, process_set=None):
    """Concatenates every rank's ``tensor`` along its first dimension, in rank order; the
    first dimension may differ between ranks, the others may not."""
    array, dtype = _as_array(tensor)
    return _from_array(_arrays.allgather(array, process_set, dtype), tensor)


def allgather_async(tensor, name=None, process_set=None):
    """Starts an ``allgather`` of ``tensor`` (copied at once) in the background; returns a
    handle whose ``synchronize`` gives the gathered tensor. On a process set it runs at
    once (the background engine serves the whole job)."""
    if _set_id(process_set) is not None:
        return _ran(allgather(tensor, name=name, process_set=process_set))
    t = _contiguous_cpu(tensor)
    rows, row_len = _rows(t)
    if row_len == 0:
        raise ValueError("allgather of rows with no elements")
    native = _hvd.allgather_async(t.data_ptr(), t.numel(), _dtype_name(t), row_len,
                                  _name("allgather", name))
    complete = _produced(native, tuple(t.shape[1:]), row_len, t.dtype, tensor.device)
    return _handle(native, lambda: complete()[0])


def allgather_object(obj, name=None, process_set=None):
    """Returns every rank's ``obj`` (any picklable object), in rank order."""
    return _arrays.allgather_object(obj, process_set)


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Sends ``splits[p]`` rows (first-dimension slices) of ``tensor`` to rank ``p`` (equal
    parts without ``splits``); returns what every rank sent here, in rank order, and how many
    rows came from each."""
    array, dtype = _as_array(tensor)
    out, received = _arrays.alltoall(array, splits, process_set, dtype)
    return _from_array(out, tensor), _torch.tensor(received, dtype=_torch.int32)


def alltoall_async(tensor, splits=None, name=None, process_set=None):
    """Starts an ``alltoall`` of ``tensor`` (copied at once) in the background; returns a
    handle whose ``synchronize`` gives what arrived and the rows received from each rank.
    On a process set it runs at once."""
    sid, _, n = _where(process_set)
    if sid is not None:
        return _ran(alltoall(tensor, splits=splits, name=name, process_set=process_set))
    t = _contiguous_cpu(tensor)
    rows, row_len = _rows(t)
    splits = _arrays.splits_of(splits, rows, n)
    native = _hvd.alltoall_async(t.data_ptr(), t.numel(), _dtype_name(t),
                                 [x * row_len for x in splits], _name("alltoall", name))
    produced = _produced(native, tuple(t.shape[1:]), row_len, t.dtype, tensor.device)

    def complete():
        out, counts = produced()
        rows = [c // max(row_len, 1) for c in counts]
        return out, _torch.tensor(rows, dtype=_torch.int32)

    return _handle(native, complete)


def reducescatter_async(tensor, name=None, op=None, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Starts a ``reducescatter`` of ``tensor`` (copied at once) in the background; returns
    a handle whose ``synchronize`` gives this rank's slice of the result. On a process set,
    or with a first dimension the ranks do not divide evenly, it runs at once."""
    op = _reducescatter_op(op)
    sid, r, n = _where(process_set)
    t = _contiguous_cpu(tensor)
    if sid is not None or t.dim() == 0 or t.shape[0] % n:
        return _ran(reducescatter(tensor, name=name, op=op, process_set=process_set,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor))
    if prescale_factor != 1.0:
        t = t.clone() if t is tensor else t
        _scale(t, prescale_factor, "prescale_factor")
    native = _hvd.reducescatter_async(t.data_ptr(), t.numel(), _dtype_name(t), op.name,
                                      _name("reducescatter", name))
    produced = _produced(native, tuple(t.shape[1:]), _rows(t)[1], t.dtype, tensor.device)

    def complete():
        out = produced()[0]
        _scale(out, postscale_factor, "postscale_factor")
        return out

    return _handle(native, complete)


def reducescatter(tensor, name=None, op=None, process_set=None, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduces ``tensor`` across ranks (default: the average) and returns this rank's slice
    of the result along the first dimension; the first ``rows % size`` ranks get one row
    more. Each rank receives only its slice: the reduction is scattered as it runs."""
    op = _reducescatter_op(op)
    t = _contiguous_cpu(tensor)
    if prescale_factor != 1.0:
        t = t.clone() if t is tensor else t
        _scale(t, prescale_factor, "prescale_factor")
    array, dtype = _as_array(t)
    out = _from_array(_arrays.reducescatter(array, op.name, process_set, dtype), t)
    _scale(out, postscale_factor, "postscale_factor")
    return out.to(tensor.device)


def _reducescatter_op(op):
    op = _op_of(None, op)
    if op is Adasum:
        raise ValueError("reducescatter reduces with hvd.Sum, Average, Min, Max or Product: "
                         "Adasum is an allreduce only")
    return op


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Returns ``root_rank``'s ``obj`` (any picklable object) on every rank (of
    ``process_set``; ``root_rank`` is a rank of the whole job)."""
    return _arrays.broadcast_object(obj, root_rank, process_set)


def broadcast_optimizer_state(optimizer, root_rank):
    """Copies ``optimizer``'s state and hyperparameters from ``root_rank`` to every rank:
    the layout (and non-tensor values) as an object, the state's tensors in place."""
    layout = broadcast_object(_optimizer_layout(optimizer), root_rank)
    tensors, load = _optimizer_receiver(optimizer, layout, "broadcast_optimizer_state")
    _broadcast_all(tensors, root_rank)
    if rank() != root_rank:
        load()


def _optimizer_layout(optimizer):
    """What a rank needs to receive ``optimizer``'s state: each entry's tensor shape and
    dtype or its value, and the parameter groups."""
    sd = optimizer.state_dict()

    def spec(v):
        if isinstance(v, _torch.Tensor):
            return ("tensor", tuple(v.shape), _dtype_name(v))
        return ("value", v)

    layout = {idx: {k: spec(v) for k, v in entries.items()}
              for idx, entries in sd["state"].items()}
    return layout, sd["param_groups"]


def _optimizer_receiver(optimizer, layout, prefix):
    """The ``(name, tensor)`` pairs to broadcast ``optimizer``'s state into, laid out as the
    root's ``layout`` (this rank's own tensors where they fit), and the function that loads
    them into the optimizer once they arrived."""
    layout, groups = layout
    mine_all = optimizer.state_dict()["state"]
    state, tensors = {}, []
    for idx, entries in layout.items():
        mine = mine_all.get(idx, {})
        state[idx] = {}
        for k, s in entries.items():
            if s[0] == "value":
                state[idx][k] = s[1]
                continue
            t = mine.get(k)
            if (not isinstance(t, _torch.Tensor) or tuple(t.shape) != s[1]
                    or _dtype_name(t) != s[2]):
                t = _torch.empty(s[1], dtype=getattr(_torch, s[2]))
            state[idx][k] = t
            tensors.append((f"{prefix}.{idx}.{k}", t))
    return tensors, lambda: optimizer.load_state_dict({"state": state, "param_groups": groups})


def broadcast_async_(tensor, root_rank, name=None):
    """Starts copying ``tensor`` from ``root_rank`` to every rank, in place."""
    name = _name("broadcast", name)
    return _submit(
        tensor,
        lambda a, n, d, owner: _hvd.broadcast_async_(a, n, d, root_rank, name, owner),
        lambda t: None)


def broadcast_async(tensor, root_rank, name=None):
    """Starts broadcasting a copy of ``tensor``; ``synchronize`` returns the result."""
    return broadcast_async_(_tensor(tensor).detach().clone(), root_rank, name=name)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0):
    """Starts reducing every tensor of ``tensors`` in place, as one fused op; returns one
    handle per tensor, in a list."""
    base = _name("grouped_allreduce", name)
    return [allreduce_async_(t, average=average, name=f"{base}.{i}", op=op,
                             prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor)
            for i, t in enumerate(tensors)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0):
    """Reduces every tensor of ``tensors`` in place, fused; returns them."""
    handles = grouped_allreduce_async_(tensors, average=average, name=name, op=op,
                                       prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor)
    return [synchronize(h) for h in handles]


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0):
    """Returns the reductions of ``tensors``, fused; the inputs are left as they were."""
    return grouped_allreduce_([_tensor(t).detach().clone() for t in tensors],
                              average=average, name=name, op=op,
                              prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0):
    """Starts reducing copies of ``tensors``; returns their handles."""
    return grouped_allreduce_async_([_tensor(t).detach().clone() for t in tensors],
                                    average=average, name=name, op=op,
                                    prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor)


__all__ = [
    "ProcessSet", "add_process_set", "global_process_set", "remove_process_set",
    "allgather", "allgather_async", "allgather_object", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async",
    "Compression", "broadcast_object", "broadcast_optimizer_state",
    "allreduce_async", "allreduce_async_", "broadcast_async", "broadcast_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "poll", "synchronize", "join", "start_timeline",
    "stop_timeline",
    "Adasum", "Average", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "Product", "Sum", "allreduce", "allreduce_", "barrier", "broadcast", "broadcast_",
    "broadcast_parameters", "cross_rank", "cross_size", "gloo_built", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "nccl_built", "rank", "shutdown", "size",
]
