"""``hvd.jax.DistributedOptimizer``: an optax ``GradientTransformation`` whose ``update``
reduces the gradients across ranks first, as one fused op per pytree."""

import optax

from hvd.common.basics import Adasum, Average, Sum, global_process_set, size
from hvd.jax.ops import allreduce


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         process_set=global_process_set):
    """Wraps the optax ``optimizer`` so that ``update(grads, state, params)`` averages
    ``grads`` across the ranks (``op``: Average, Sum or Adasum) before ``optimizer`` sees
    them; eagerly and inside ``jax.jit``. With ``backward_passes_per_step`` k > 1 the
    gradients of k calls are summed locally (as Horovod sums the gradients of k backward
    passes) and reduced and applied on every k-th call; the calls between return zero
    updates. ``gradient_predivide_factor`` f divides the gradients by f before the sum and by
    size / f after it, as Horovod does. ``named_parameters`` and ``compression`` are accepted
    for Horovod's signature."""
    del named_parameters, compression
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be at least 1, not "
                         f"{backward_passes_per_step}")
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer reduces gradients with hvd.Average, Sum or "
                         f"Adasum, not {op!r}")
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor applies to hvd.Average only")

    def reduce(grads):
        if gradient_predivide_factor != 1.0:
            n = process_set.size() if process_set is not global_process_set else size()
            return allreduce(grads, op=Sum, prescale_factor=1.0 / gradient_predivide_factor,
                             postscale_factor=gradient_predivide_factor / n,
                             process_set=process_set)
        return allreduce(grads, op=op, process_set=process_set)

    def update(updates, state, params=None):
        return optimizer.update(reduce(updates), state, params)

    reducing = optax.GradientTransformation(optimizer.init, update)
    if backward_passes_per_step == 1:
        return reducing
    return optax.MultiSteps(reducing, every_k_schedule=backward_passes_per_step,
                            use_grad_mean=False).gradient_transformation()
