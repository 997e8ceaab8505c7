"""``DistributedOptimizer``: Horovod's wrapper that averages gradients across ranks.

Each gradient is submitted to the background engine the moment autograd has accumulated it
(``Tensor.register_post_accumulate_grad_hook``), so communication overlaps the rest of the
backward pass and the engine fuses what is ready together; ``step()`` waits for them.
"""

import contextlib
import os
import warnings

import torch

from hvd.torch import compression as _compression
from hvd.torch import ops as _ops


class _Hooked:
    """What both wrappers share: a hook on every trained parameter, counting its backward
    passes, and Horovod's guard on ``zero_grad``."""

    def _hvd_hook_all(self, params):
        """Hooks every trained parameter (in a world of one only for elastic jobs, which may
        grow)."""
        self._hvd_hooks = []
        if _ops.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1":
            for p in params:
                if p.requires_grad:
                    self._hvd_hooks.append(p.register_post_accumulate_grad_hook(self._hvd_hook))

    def _hvd_pass_done(self, p):
        """Counts a backward pass of ``p``; whether it completed ``backward_passes_per_step``
        of them."""
        key = id(p)
        if key in self._hvd_pending:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._hvd_delay[key] -= 1
        return self._hvd_delay[key] == 0

    def zero_grad(self, *args, **kwargs):
        if self._hvd_pending:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


class _DistributedOptimizer(_Hooked):
    """Methods mixed into a subclass of the user's optimizer class."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, process_set, groups):
        if op not in (_ops.Average, _ops.Sum):
            raise ValueError(f"DistributedOptimizer reduces with hvd.Average or hvd.Sum, not {op!r}")
        if gradient_predivide_factor != 1.0 and op is not _ops.Average:
            raise ValueError("gradient_predivide_factor applies only with op=hvd.Average")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, not "
                             f"{backward_passes_per_step}")
        params = [p for group in self.param_groups for p in group["params"]]
        by_param = _names_of(self.param_groups, named_parameters)
        self._hvd_names = by_param
        self._hvd_set = process_set
        self._hvd_compression = compression
        self._hvd_passes = backward_passes_per_step
        self._hvd_op = op
        self._hvd_gpf = gradient_predivide_factor
        self._hvd_delay = {id(p): backward_passes_per_step for p in params}
        self._hvd_pending = {}
        self._hvd_synchronized = False
        self._hvd_skip = False
        self._hvd_group_of, self._hvd_groups = _groups_of(
            [p for p in params if p.requires_grad], groups)
        self._hvd_ready = {g: [] for g in range(len(self._hvd_groups))}
        self._hvd_hook_all(params)

    def _hvd_hook(self, p):
        if not self._hvd_pass_done(p):
            return
        key = id(p)
        g = self._hvd_group_of.get(key)
        if g is None:
            self._hvd_pending[key] = (p, self._hvd_submit(p))
            return
        # A group goes to the engine together, once its last gradient is ready, so its
        # tensors are agreed in one cycle and fused.
        ready = self._hvd_ready[g]
        ready.append(p)
        if len(ready) == len(self._hvd_groups[g]):
            self._hvd_submit_group(g)

    def _hvd_submit_group(self, g):
        """Submits every gradient of group ``g`` (zeros for those that have none)."""
        for p in self._hvd_groups[g]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._hvd_pending[id(p)] = (p, self._hvd_submit(p))
        self._hvd_ready[g] = []

    def _hvd_submit(self, p):
        compressed, ctx = self._hvd_compression.compress(p.grad)
        if self._hvd_op is _ops.Average:
            pre, post = 1.0 / self._hvd_gpf, self._hvd_gpf
        else:
            pre, post = 1.0, 1.0
        handle = _ops.allreduce_async_(compressed, name=self._hvd_names[id(p)],
                                       op=self._hvd_op, prescale_factor=pre,
                                       postscale_factor=post, process_set=self._hvd_set)
        return handle, ctx

    def synchronize(self):
        """Waits for every gradient's allreduce; a parameter whose hook never fired (no
        gradient this step) is reduced as zeros, so every rank takes part in every name."""
        if not self._hvd_hooks:
            self._hvd_synchronized = True
            return
        for g, ready in self._hvd_ready.items():
            if ready or not any(id(p) in self._hvd_pending for p in self._hvd_groups[g]):
                self._hvd_submit_group(g)
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad or id(p) in self._hvd_pending:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._hvd_pending[id(p)] = (p, self._hvd_submit(p))
        try:
            for p, (handle, ctx) in self._hvd_pending.values():
                out = _ops.synchronize(handle)
                if out is not p.grad:
                    with torch.no_grad():
                        p.grad.copy_(self._hvd_compression.decompress(out, ctx))
        finally:
            self._hvd_pending.clear()
            for key in self._hvd_delay:
                self._hvd_delay[key] = self._hvd_passes
        self._hvd_synchronized = True

    def _hvd_reset(self):
        """Forgets the reductions of a round that failed (elastic resets)."""
        self._hvd_pending.clear()
        self._hvd_ready = {g: [] for g in self._hvd_ready}
        for key in self._hvd_delay:
            self._hvd_delay[key] = self._hvd_passes
        self._hvd_synchronized = False

    @contextlib.contextmanager
    def skip_synchronize(self):
        """A ``step()`` inside it does not synchronize: for a ``synchronize()`` called
        earlier (to clip gradients, say)."""
        self._hvd_skip = True
        try:
            yield
        finally:
            self._hvd_skip = False

    def step(self, closure=None):
        if not self._hvd_skip:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): the gradients are reduced again. "
                              "Use `with optimizer.skip_synchronize():` around step().")
            self.synchronize()
        self._hvd_synchronized = False
        return super(self.__class__, self).step(closure)


def _names_of(param_groups, named_parameters):
    """{id(param): the name its reduction goes by}: from ``named_parameters`` (checked: pairs,
    unique names, every parameter named), or generated from the parameters' positions."""
    params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        return {id(p): f"allreduce.noname.{i}.{j}"
                for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not isinstance(n, tuple) or len(n) != 2 for n in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, as "
                         "model.named_parameters() gives")
    names = [n for n, _ in named]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"parameter names must be unique; repeated: {dupes}")
    by_param = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in by_param]
    if missing:
        raise ValueError(f"named_parameters does not name {len(missing)} parameter(s) "
                         f"of the optimizer (positions {missing[:8]})")
    return by_param


class _DistributedAdasumOptimizer(_Hooked):
    """Methods mixed into a subclass of the user's optimizer class for ``op=hvd.Adasum``:
    Horovod's delta form. Each parameter is stepped by the wrapped optimizer on its own local
    gradient as soon as that gradient is ready (after ``backward_passes_per_step`` passes);
    the change it made (the delta) is what the ranks combine with Adasum, and ``step()`` sets
    every parameter to its value before the local step plus the combined delta."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, process_set, groups):
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor applies only with op=hvd.Average")
        if groups not in (None, 0):
            raise ValueError("groups is not supported with op=hvd.Adasum: each parameter's "
                             "delta is combined on its own")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, not "
                             f"{backward_passes_per_step}")
        params = [p for group in self.param_groups for p in group["params"]]
        self._hvd_names = _names_of(self.param_groups, named_parameters)
        self._hvd_set = process_set
        self._hvd_compression = compression
        self._hvd_passes = backward_passes_per_step
        self._hvd_delay = {id(p): backward_passes_per_step for p in params}
        self._hvd_start = {}
        self._hvd_pending = {}
        self._hvd_hook_all(params)

    def _hvd_hook(self, p):
        if self._hvd_pass_done(p):
            self._hvd_pending[id(p)] = (p, self._hvd_submit(p))

    def _hvd_submit(self, p):
        """Steps ``p`` alone on its local gradient, leaves the delta in ``p`` and submits its
        Adasum; the value before the step is kept to add the combined delta to."""
        start = self._hvd_start.get(id(p))
        if start is None:
            start = self._hvd_start[id(p)] = torch.empty_like(p, requires_grad=False)
        with torch.no_grad():
            start.copy_(p)
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [q for q in group["params"] if q is p]
            super(self.__class__, self).step()
        finally:
            for group, kept in zip(self.param_groups, stashed):
                group["params"] = kept
        with torch.no_grad():
            p.sub_(start)
        compressed, ctx = self._hvd_compression.compress(p.data)
        handle = _ops.allreduce_async_(compressed, name=self._hvd_names[id(p)], op=_ops.Adasum,
                                       process_set=self._hvd_set)
        return handle, ctx

    def synchronize(self):
        """Steps and submits every parameter not submitted yet, waits for every combined
        delta and applies it: each parameter becomes its value before the local step plus
        the Adasum of the ranks' deltas."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in self._hvd_pending:
                    self._hvd_pending[id(p)] = (p, self._hvd_submit(p))
        try:
            for p, (handle, ctx) in self._hvd_pending.values():
                delta = self._hvd_compression.decompress(_ops.synchronize(handle), ctx)
                start = self._hvd_start[id(p)]
                with torch.no_grad():
                    start.add_(delta.to(start.dtype))
                    p.copy_(start)
        finally:
            self._hvd_pending.clear()
            for key in self._hvd_delay:
                self._hvd_delay[key] = self._hvd_passes

    def _hvd_reset(self):
        """Forgets the reductions of a round that failed (elastic resets)."""
        self._hvd_pending.clear()
        for key in self._hvd_delay:
            self._hvd_delay[key] = self._hvd_passes

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.synchronize()
        return loss


def DistributedOptimizer(optimizer, named_parameters=None,
                         compression=_compression.Compression.none,
                         backward_passes_per_step=1, op=_ops.Average,
                         gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                         process_set=None):
    """Wraps ``optimizer`` so that ``step()`` applies gradients averaged over every rank.

    As in Horovod, the result is an instance of a subclass of the optimizer's class, built
    from its parameter groups (its state starts empty). With ``op=hvd.Adasum`` it combines
    the local optimizer's parameter deltas by Adasum instead (Horovod's Adasum optimizer).
    """
    mixin = _DistributedAdasumOptimizer if op is _ops.Adasum else _DistributedOptimizer
    methods = {}
    for klass in reversed(mixin.__mro__[:-1]):  # the shared methods first, then the mixin's
        methods.update({k: v for k, v in klass.__dict__.items()
                        if k not in ("__dict__", "__weakref__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    opt = cls.__new__(cls)
    optimizer.__class__.__init__(opt, optimizer.param_groups)
    opt._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, process_set, groups)
    return opt


def _groups_of(params, groups):
    """Horovod's ``groups``: ``None`` or 0 (no explicit groups), a number of groups to cut
    ``params`` into (contiguous, as even as can be), or lists of parameters (each list one
    group; a parameter in none is its own). Returns ({id(param): group}, [group's params])."""
    if groups is None or (isinstance(groups, int) and not isinstance(groups, bool)
                          and groups == 0):
        return {}, []
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative number or lists of parameters, "
                             f"not {groups}")
        base, extra = divmod(len(params), groups)
        lists, at = [], 0
        for g in range(groups):
            width = base + (1 if g < extra else 0)
            if width:
                lists.append(params[at:at + width])
            at += width
    elif isinstance(groups, (list, tuple)) and all(isinstance(g, (list, tuple))
                                                   for g in groups):
        known = {id(p) for p in params}
        lists, seen = [], set()
        for g in groups:
            for p in g:
                if id(p) not in known:
                    raise ValueError("groups names a parameter the optimizer does not train "
                                     f"(shape {tuple(getattr(p, 'shape', ()))})")
                if id(p) in seen:
                    raise ValueError("groups names a parameter twice "
                                     f"(shape {tuple(p.shape)})")
                seen.add(id(p))
            if g:
                lists.append(list(g))
    else:
        raise ValueError(f"groups must be a non-negative number or lists of parameters, not "
                         f"{type(groups).__name__}")
    return {id(p): k for k, g in enumerate(lists) for p in g}, lists
