"""Data-parallel and elastic training for JAX over hvd: ``import hvd.jax as hvd``.

Horovod's API in JAX's idioms: the collectives take ``jax.Array``s or whole pytrees (one
fused op per pytree), eagerly and inside ``jax.jit``; ``DistributedOptimizer`` wraps an
optax ``GradientTransformation``; ``broadcast_parameters`` starts every rank from rank 0's
parameters; ``hvd.jax.elastic.JaxState`` keeps a training loop's pytrees through membership
changes on hvd's one elastic core.
"""

from hvd.jax.ops import *  # noqa: F401,F403 (the API, as ``ops.__all__`` lists it)
from hvd.jax.ops import __all__ as _ops_all
from hvd.jax.optimizer import DistributedOptimizer
from hvd.jax import elastic

__all__ = sorted(set(_ops_all) | {"DistributedOptimizer", "elastic"})
