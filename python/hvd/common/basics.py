"""What every framework binding shares: joining the job, the world's shape, the reductions'
names and the process sets. ``hvd.torch`` and ``hvd.tensorflow`` re-export these."""

from hvd import _hvd


class _Op:
    """A reduction, named as Horovod names it."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return "hvd." + self.name.capitalize()


Average = _Op("average")
Sum = _Op("sum")
Min = _Op("min")
Max = _Op("max")
Product = _Op("product")
Adasum = _Op("adasum")


def _op_of(average, op):
    """The reduction Horovod's ``op``/deprecated ``average`` arguments name (default: the
    average); a clear error for anything else."""
    if average is not None:
        if op is not None:
            raise ValueError("pass either op or the deprecated average, not both")
        return Average if average else Sum
    op = Average if op is None else op
    if not isinstance(op, _Op):
        raise ValueError(f"unknown reduction {op!r}: use hvd.Average, Sum, Min, Max, Product "
                         f"or Adasum")
    return op


def init(comm=None, process_sets=None):
    """Joins the job ``horovodrun`` started this process in; a world of one without it."""
    if comm is not None:
        raise ValueError("hvd.init(comm=...) is MPI's; hvd runs without MPI")
    _hvd.init()
    for ps in process_sets or []:
        add_process_set(ps)


def shutdown():
    """Leaves the job cleanly."""
    _hvd.shutdown()


def is_initialized():
    """Whether ``init()`` was called, and ``shutdown()`` not since."""
    return _hvd.is_initialized()


def rank():
    """This process's rank in the job."""
    return _hvd.topology()[0]


def size():
    """The number of processes in the job."""
    return _hvd.topology()[1]


def local_rank():
    """This process's rank among those on its host."""
    return _hvd.topology()[2]


def local_size():
    """The number of processes on this host."""
    return _hvd.topology()[3]


def cross_rank():
    """This host's index among the hosts with a process of this local rank."""
    return _hvd.topology()[4]


def cross_size():
    """The number of hosts with a process of this local rank."""
    return _hvd.topology()[5]


def is_homogeneous():
    """Whether every host runs the same number of processes."""
    return _hvd.topology()[6]


def gloo_built():
    """True: hvd's transport is its own TCP and shared-memory collectives, Gloo's role."""
    return True


def nccl_built():
    """False: this build has no NCCL path."""
    return False


def mpi_built():
    """False: hvd runs without MPI."""
    return False


def mpi_enabled():
    """False: hvd runs without MPI."""
    return False


class ProcessSet:
    """A subset of the ranks that collectives can run among (``process_set=``). Create it on
    every rank with ``add_process_set``; ``global_process_set`` is the whole job."""

    def __init__(self, ranks):
        self.ranks = sorted(int(r) for r in ranks)
        self.process_set_id = None

    def included(self):
        """Whether this rank is a member."""
        return self is global_process_set or rank() in self.ranks

    def rank(self):
        """This rank's index among the members."""
        return rank() if self is global_process_set else self.ranks.index(rank())

    def size(self):
        """The number of members."""
        return size() if self is global_process_set else len(self.ranks)

    def __repr__(self):
        if self is global_process_set:
            return "ProcessSet(global)"
        return f"ProcessSet(id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])


def add_process_set(process_set):
    """Creates ``process_set`` (a ``ProcessSet`` or a list of ranks) on this rank; every rank
    must call it with the same ranks, in the same order of calls. Returns the set."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} was added already")
    ps.process_set_id, ps.ranks = _hvd.add_process_set(ps.ranks)
    return ps


def remove_process_set(process_set):
    """Removes ``process_set`` on this rank; every rank should remove it too."""
    if process_set is global_process_set or process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not an added process set")
    _hvd.remove_process_set(process_set.process_set_id)
    process_set.process_set_id = None


def _set_id(process_set):
    """The native id of ``process_set``, or None for the whole job."""
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not an added process set: call "
                         f"hvd.add_process_set first")
    return process_set.process_set_id


def _where(process_set):
    """(native set id or None, this rank's index there, the number of members)."""
    sid = _set_id(process_set)
    if sid is None:
        return None, rank(), size()
    if not process_set.included():
        raise RuntimeError(f"rank {rank()} is not in process set {process_set.process_set_id} "
                           f"(ranks {process_set.ranks})")
    return sid, process_set.rank(), process_set.size()


__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "ProcessSet", "add_process_set",
    "cross_rank", "cross_size", "gloo_built", "global_process_set", "init",
    "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "nccl_built", "rank", "remove_process_set", "shutdown", "size",
]
