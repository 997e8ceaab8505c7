"""Elastic training with JAX on hvd's one elastic core (``hvd.elastic``: ``State``, ``run``,
``ElasticSampler``), which decides every sync in Rust. This module says only how JAX values
are saved, restored and broadcast.

JAX arrays are immutable, so a commit copies nothing: it keeps references to the pytrees the
training step returned, and a rollback puts them back. A sync broadcasts the pytrees from
the rank that holds the newest commit, each as one batch of broadcasts.
"""

import copy

import jax

from hvd.common import arrays as _arrays
from hvd.elastic import (ElasticSampler, HorovodInternalError,  # noqa: F401
                         HostsUpdatedInterrupt, ObjectState, State, run)
from hvd.jax import ops as _ops


def _has_arrays(value):
    return any(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(value))


class JaxState(ObjectState):
    """State of a JAX training loop: pytrees of arrays (``params=``, ``opt_state=``, Flax's
    variables) and plain attributes (``epoch=``, ``batch=``, an ``ElasticSampler``), all set
    as attributes. Assign the new pytrees after each step (``state.params = params``) and
    ``commit()`` every few steps; after a failure every rank returns to its last commit and
    the new members receive it."""

    def __init__(self, params=None, opt_state=None, **kwargs):
        values = dict(kwargs)
        if params is not None:
            values["params"] = params
        if opt_state is not None:
            values["opt_state"] = opt_state
        super().__init__(**values)

    def _trees(self):
        return [k for k in self._values if _has_arrays(getattr(self, k))]

    def save(self):
        trees = self._trees()
        # Immutable: the references are the copy.
        kept = {k: getattr(self, k) for k in trees}
        rest = {k: v for k, v in self._snapshot().items() if k not in kept}
        self._saved = {"trees": kept, "rest": copy.deepcopy(rest)}

    def restore(self):
        for k, v in self._saved.get("trees", {}).items():
            setattr(self, k, v)
        self._apply(copy.deepcopy(self._saved.get("rest", {})))

    def _sync_from(self, root):
        trees = self._trees()
        for k in trees:
            setattr(self, k, _ops.broadcast_parameters(getattr(self, k), root))
        rest = {k: v for k, v in self._snapshot().items() if k not in trees}
        self._apply(_arrays.broadcast_object(rest, root))


__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "JaxState",
           "ObjectState", "State", "run"]
