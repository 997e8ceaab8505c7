"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are averaged (or
reduced as ``op`` says) across the ranks before they are returned, as Horovod's."""

import os
import warnings

import tensorflow as tf

from hvd.common.basics import Average, global_process_set
from hvd.tensorflow import ops as _ops
from hvd.tensorflow.compression import Compression


def check_grouping(op, gradient_predivide_factor, num_groups, groups):
    """Horovod's checks of a gradient reducer's arguments; returns the groups to use."""
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "tf.Variable.")
    return groups


def _split(items, n):
    """``items`` in ``n`` consecutive parts of sizes that differ by one at most."""
    base, extra = divmod(len(items), n)
    parts, at = [], 0
    for k in range(n):
        width = base + (1 if k < extra else 0)
        parts.append(items[at:at + width])
        at += width
    return [p for p in parts if p]


def communicates(process_set):
    """Whether a reduction can change anything: more than one rank, or an elastic job,
    whose world may grow (decided when a step is traced; a static world never changes)."""
    return process_set.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"


def make_reducer(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                 process_set):
    """A function ``(grads, vars) -> reduced grads`` that reduces gradients as Horovod's
    ``DistributedGradientTape``/``DistributedOptimizer`` do: each group of gradients as
    one fused op (without ``groups``, all of them together), ``None`` kept as it is."""
    if op is Average:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    else:
        prescale = postscale = 1.0

    def reduce(grads, variables):
        grads = list(grads)
        if sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        if not present or not process_set.included() or not communicates(process_set):
            return grads
        if isinstance(groups, list):
            where = {id(v): i for i, v in enumerate(variables)}
            chosen = set()
            split = []
            for group in groups:
                members = [(where[id(v)], grads[where[id(v)]]) for v in group
                           if id(v) in where and grads[where[id(v)]] is not None]
                chosen.update(i for i, _ in members)
                split.append(members)
            split += [[(i, g)] for i, g in present if i not in chosen]
            split = [s for s in split if s]
        elif groups:
            split = _split(present, groups)
        else:
            split = [present]
        out = list(grads)
        for part in split:
            idx, gs = zip(*part)
            reduced = _ops.grouped_allreduce(list(gs), compression=compression, op=op,
                                             prescale_factor=prescale,
                                             postscale_factor=postscale,
                                             process_set=process_set)
            for i, r in zip(idx, reduced):
                out[i] = r
        return out

    return reduce


def _ranks(process_set, dtype):
    """The ranks of ``process_set`` as a ``dtype`` scalar: read when the graph runs in an
    elastic job, whose world changes under a traced step, else known now (Horovod's
    choice)."""
    if os.environ.get("HOROVOD_ELASTIC") == "1" and not tf.executing_eagerly():
        return tf.cast(_ops.size_op(process_set.process_set_id or 0), dtype)
    return tf.cast(process_set.size(), dtype)


def reduce_sharing(reduce, grads, variables, local, scale_local, process_set):
    """``grads`` of ``variables`` reduced by ``reduce``, but those of the variables whose
    ``id`` is in ``local`` (registered as this rank's own), which are kept, and divided by
    the ranks when ``scale_local`` (as Horovod's ``scale_local_gradients``: a rank's own
    gradient then weighs as it would in the average)."""
    grads = list(grads)
    if not local:
        return list(reduce(grads, variables))
    shared = [i for i, v in enumerate(variables) if id(v) not in local]
    reduced = reduce([grads[i] for i in shared], [variables[i] for i in shared])
    for i, g in zip(shared, reduced):
        grads[i] = g
    if scale_local:
        for i, v in enumerate(variables):
            g = grads[i]
            if id(v) not in local or g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                n = _ranks(process_set, g.values.dtype)
                grads[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
            else:
                grads[i] = g / _ranks(process_set, g.dtype)
    return grads


class _DistributedGradientTape(tf.GradientTape):
    """The methods a ``DistributedGradientTape`` adds to the tape it wraps."""

    def _hvd_setup(self, reduce, process_set, scale_local_gradients):
        self._allreduce_grads = reduce
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        # By identity: Keras 3 variables have no ``ref()``; the values keep them alive.
        self._local_sources = {}

    def register_local_source(self, source):
        """Marks ``source`` as this rank's own: its gradient is not reduced (only scaled by
        the ranks when ``scale_local_gradients``)."""
        self._local_sources[id(source)] = source

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 **kwargs):
        """The tape's gradients of ``target`` with respect to ``sources``, reduced across the
        ranks (all but the local sources')."""
        flat = tf.nest.flatten(sources)
        grads = super().gradient(target, flat, output_gradients, **kwargs)
        grads = reduce_sharing(self._allreduce_grads, grads, flat, self._local_sources,
                               self.scale_local_gradients, self.process_set)
        return tf.nest.pack_sequence_as(sources, grads)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """The gradients split into the local sources' and the reduced ones, each a list of
        (source, gradient)."""
        grads = self.gradient(target, sources, output_gradients)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if id(s) in self._local_sources else shared).append((s, g))
        return local, shared


def DistributedGradientTape(gradtape, device_dense='', device_sparse='',
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """Wraps ``gradtape`` so that ``gradient`` returns the gradients reduced across the ranks
    (of ``process_set``; default: averaged), each group of them as one fused op (all of
    them together without ``groups``, where Horovod's engine would fuse them anyway).
    ``sparse_as_dense`` densifies ``tf.IndexedSlices``, which are otherwise allgathered.
    ``gradient_predivide_factor`` splits the average before and after the sum. Sources
    registered with ``register_local_source`` keep their own gradients (divided by the
    ranks with ``scale_local_gradients``). ``device_*`` are accepted for Horovod's
    signature."""
    groups = check_grouping(op, gradient_predivide_factor, num_groups, groups)
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_setup(make_reducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                                 groups, process_set),
                    process_set, scale_local_gradients)
    return tape
