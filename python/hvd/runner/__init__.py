"""``hvd.run``: Horovod's programmatic launcher (``horovod.run``) over hvd's ``horovodrun``.

It starts ``horovodrun`` as a child process with the flags its arguments name, each worker
running ``python -m hvd.runner.task``, and returns the workers' return values.
"""

import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from collections import deque

from hvd.runner import wire

__all__ = ["run"]

#: The variable naming the ``horovodrun`` binary; ``PATH`` is searched without it.
ENV_HOROVODRUN = "HVD_HOROVODRUN"

#: ``horovodrun``'s exit code for arguments it refuses (sysexits' EX_USAGE).
_EX_USAGE = 64

#: A line ``horovodrun`` relays from a worker: `[label]<stdout>:`, perhaps after the time.
_WORKER_LINE = re.compile(rb"^[^\[]*\[[^\]]*\]<std(?:out|err)>:")


def run(func, args=(), kwargs=None, num_proc=1, min_num_proc=None, max_num_proc=None,
        slots=None, reset_limit=None, cooldown_range=None, hosts=None, hostfile=None,
        host_discovery_script=None, start_timeout=None, ssh_port=None, ssh_identity_file=None,
        disable_cache=None, output_filename=None, verbose=None, use_gloo=None, use_mpi=None,
        mpi_args=None, network_interface=None, network_interfaces=None, executable=None,
        np=None, min_np=None, max_np=None):
    """Runs ``func(*args, **kwargs)`` on every rank of a job ``horovodrun`` starts and returns
    the return values in rank order (Horovod's ``horovod.run``, same arguments and meaning).

    An elastic job (``min_num_proc`` or ``host_discovery_script`` given) returns, as Horovod's,
    the values of ranks ``0 .. min_num_proc - 1`` of the workers that finished. A function that
    raises on a rank raises ``RuntimeError`` here with that rank's traceback; arguments
    ``horovodrun`` refuses (MPI among them) raise ``ValueError`` with its reason.
    """
    if not callable(func):
        raise TypeError(f"hvd.run: func must be callable, not {type(func).__name__}")
    if network_interface:
        network_interfaces = network_interface.split(",")
        warnings.warn("network_interface is deprecated, use network_interfaces instead",
                      DeprecationWarning, stacklevel=2)
    for old, new, value in (("np", "num_proc", np), ("min_np", "min_num_proc", min_np),
                            ("max_np", "max_num_proc", max_np)):
        if value is not None:
            warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning,
                          stacklevel=2)
    num_proc = num_proc if np is None else np
    min_num_proc = min_num_proc if min_np is None else min_np
    max_num_proc = max_num_proc if max_np is None else max_np

    flags = _flags(num_proc=num_proc, min_num_proc=min_num_proc, max_num_proc=max_num_proc,
                   slots=slots, reset_limit=reset_limit, cooldown_range=cooldown_range,
                   hosts=hosts, hostfile=hostfile,
                   host_discovery_script=host_discovery_script, start_timeout=start_timeout,
                   ssh_port=ssh_port, ssh_identity_file=ssh_identity_file,
                   disable_cache=disable_cache, output_filename=output_filename,
                   verbose=verbose, use_gloo=use_gloo, use_mpi=use_mpi, mpi_args=mpi_args,
                   network_interfaces=network_interfaces)
    call = (func, tuple(args), dict(kwargs or {}))
    try:
        payload = wire.dumps(call)
    except Exception as e:
        hint = "" if wire.CLOUDPICKLE else (
            "; install cloudpickle to send closures, lambdas and functions of __main__")
        raise TypeError(f"hvd.run: cannot pickle func and its arguments: {e}{hint}") from e

    nonce = secrets.token_hex(8)
    with tempfile.TemporaryDirectory(prefix="hvd-run-") as spill:
        command = [_horovodrun(), *flags, executable or sys.executable, "-m",
                   "hvd.runner.task", nonce, wire.function_argument(payload, spill)]
        collector, code, driver_lines = _supervise(command, nonce)
    if output_filename and os.path.isdir(output_filename):
        wire.strip_output_files(output_filename, nonce)

    if code == _EX_USAGE:
        raise ValueError(_refusal(driver_lines, flags))
    if code != 0:
        raise RuntimeError(_failure(collector, code, driver_lines))
    if host_discovery_script is not None or min_num_proc is not None:
        ranks = sorted(collector.ok)[:int(min_num_proc or num_proc)]
    else:
        missing = [r for r in range(int(num_proc)) if r not in collector.ok]
        if missing:
            raise RuntimeError(
                f"hvd.run: ranks {missing} returned no result, yet horovodrun succeeded: did "
                f"the function end its process (os._exit)?\n{_tail(driver_lines)}")
        ranks = range(int(num_proc))
    return [_unpickle(collector.ok[r], r) for r in ranks]


#: Each argument of :func:`run` that is a ``horovodrun`` flag with a value, and the flag.
_VALUED = {
    "num_proc": "--num-proc",
    "min_num_proc": "--min-np",
    "max_num_proc": "--max-np",
    "slots": "--slots",
    "reset_limit": "--reset-limit",
    "hosts": "--hosts",
    "hostfile": "--hostfile",
    "host_discovery_script": "--host-discovery-script",
    "start_timeout": "--start-timeout",
    "ssh_port": "--ssh-port",
    "ssh_identity_file": "--ssh-identity-file",
    "output_filename": "--output-filename",
    "mpi_args": "--mpi-args",
}

#: Each argument of :func:`run` that is a ``horovodrun`` switch, and the switch.
_SWITCHES = {
    "disable_cache": "--disable-cache",
    "verbose": "--verbose",
    "use_gloo": "--gloo",
    "use_mpi": "--mpi",
}


def _flags(cooldown_range, network_interfaces, **given):
    """``horovodrun``'s flags for :func:`run`'s arguments; ``horovodrun`` checks their values."""
    flags = []
    for name, flag in _VALUED.items():
        if given[name] is not None:
            flags += [flag, os.fspath(given[name]) if isinstance(given[name], os.PathLike)
                      else str(given[name])]
    flags += [flag for name, flag in _SWITCHES.items() if given[name]]
    if cooldown_range is not None:
        try:
            lo, hi = cooldown_range
        except (TypeError, ValueError):
            raise ValueError("hvd.run: cooldown_range must be (min, max) seconds, not "
                             f"{cooldown_range!r}") from None
        flags += ["--blacklist-cooldown-range", str(lo), str(hi)]
    if network_interfaces:
        names = ([network_interfaces] if isinstance(network_interfaces, str)
                 else list(network_interfaces))
        flags += ["--network-interfaces", ",".join(names)]
    return flags


def _horovodrun():
    """The ``horovodrun`` binary: ``$HVD_HOROVODRUN``, else the one on ``PATH``."""
    named = os.environ.get(ENV_HOROVODRUN)
    if named:
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            raise FileNotFoundError(f"hvd.run: {ENV_HOROVODRUN}={named} is no executable file")
        return named
    found = shutil.which("horovodrun")
    if found is None:
        raise FileNotFoundError(
            "hvd.run starts hvd's launcher, horovodrun, which is not on PATH: build it with "
            "`cargo build --release -p hvd-driver` and put target/release on PATH, or set "
            f"{ENV_HOROVODRUN} to its path")
    return found


def _supervise(command, nonce):
    """Runs ``horovodrun`` to its end, echoing its output without the result lines; returns
    the results, its exit code and the last lines it wrote itself on stderr."""
    collector = wire.Collector(nonce)
    driver_lines = deque(maxlen=40)
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    relay = threading.Thread(target=_relay_stderr, args=(proc.stderr, driver_lines),
                             daemon=True)
    relay.start()
    try:
        for line in proc.stdout:
            left = collector.split(line)
            if left is not None:
                _write(sys.stdout, left)
        code = proc.wait()
    except BaseException:
        # Interrupted (Ctrl-C): horovodrun stops its workers on SIGINT, as on a terminal.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    finally:
        relay.join(timeout=5)
        proc.stdout.close()
    return collector, code, list(driver_lines)


def _relay_stderr(pipe, driver_lines):
    """Copies ``horovodrun``'s stderr to ``sys.stderr``, keeping its own (not the workers')
    last lines for error messages."""
    for line in pipe:
        _write(sys.stderr, line)
        if not _WORKER_LINE.match(line):
            driver_lines.append(line.decode("utf-8", "replace").rstrip("\n"))
    pipe.close()


def _write(stream, line):
    stream.write(line.decode("utf-8", "replace"))
    stream.flush()


def _tail(lines):
    return "\n".join(lines)


def _refusal(driver_lines, flags):
    """The reason ``horovodrun`` refused its arguments, naming :func:`run`'s argument."""
    # Its error lines, without clap's usage and hints.
    text = _tail(line for line in driver_lines if "error:" in line) or _tail(driver_lines)
    spellings = [*_VALUED.items(), *_SWITCHES.items(), ("num_proc", "-np"),
                 ("cooldown_range", "--blacklist-cooldown-range"),
                 ("network_interfaces", "--network-interfaces")]
    for name, spelling in spellings:
        given = _VALUED.get(name) or _SWITCHES.get(name) or spelling
        if given in flags and re.search(rf"(?<![\w-]){re.escape(spelling)}(?![\w-])", text):
            return f"hvd.run: argument {name} refused by horovodrun: {text}"
    return f"hvd.run: horovodrun refused its arguments {flags}: {text}"


def _failure(collector, code, driver_lines):
    """Why the job failed: the tracebacks of the ranks whose function raised, else what
    ``horovodrun`` said."""
    if collector.err:
        ranks = sorted(collector.err)
        parts = [f"rank {r} raised:\n{collector.err[r].decode('utf-8', 'replace')}"
                 for r in ranks]
        which = "rank" if len(ranks) == 1 else "ranks"
        return (f"hvd.run: the function failed on {which} {', '.join(map(str, ranks))}\n"
                + "\n".join(parts))
    return f"hvd.run: horovodrun exited with code {code}:\n{_tail(driver_lines)}"


def _unpickle(data, rank):
    try:
        return pickle.loads(data)
    except Exception as e:
        raise RuntimeError(f"hvd.run: cannot unpickle the result of rank {rank}: {e}") from e
