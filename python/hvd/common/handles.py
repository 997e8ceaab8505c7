"""The handles of asynchronous ops, shared by every framework binding: an int per op, as
in Horovod, and the names generated for unnamed ops (every rank submits its unnamed ops of a
kind in the same order, so the generated names match)."""


class _Done:
    """The handle of an op that already ran (asynchronous calls on a process set run at
    once: the background engine serves the whole job)."""

    def poll(self):
        return True

    def wait(self):
        return None


# Asynchronous ops: the background engine matches them across ranks by name and fuses
# allreduces that are ready together. A handle is an int, as in Horovod.
_handles = {}
_next_handle = [0]
_unnamed = {}


def _name(kind, name):
    """``name``, or the next generated one: every rank submits its unnamed ops of a kind in
    the same order, so the generated names match."""
    if name is not None:
        return str(name)
    _unnamed[kind] = _unnamed.get(kind, 0) + 1
    return f"{kind}.noname.{_unnamed[kind]}"


def _handle(native, complete):
    """Registers the op ``native`` (with ``poll()`` and ``wait()``) and returns its handle;
    ``complete()`` waits for it and gives what ``synchronize`` returns."""
    _next_handle[0] += 1
    h = _next_handle[0]
    _handles[h] = (native, complete)
    return h


def _ran(result):
    """The handle of an op that already ran, giving ``result``."""
    return _handle(_Done(), lambda: result)


def poll(handle):
    """Whether the op of ``handle`` has finished; never blocks."""
    if handle not in _handles:
        raise ValueError(f"unknown handle {handle}: already synchronized, or never returned")
    return _handles[handle][0].poll()


def synchronize(handle):
    """Waits for the op of ``handle`` and returns its output: the tensor (an alltoall's
    with the row counts received from each rank)."""
    try:
        _, complete = _handles.pop(handle)
    except KeyError:
        raise ValueError(f"unknown handle {handle}: already synchronized, or never returned")
    return complete()


def forget_all():
    """Drops every pending handle and restarts the generated names: after a membership
    change the ops in flight are gone, and a new round names its ops as a new worker does."""
    _handles.clear()
    _unnamed.clear()
