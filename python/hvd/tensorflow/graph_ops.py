"""hvd's compiled TensorFlow op, built from ``graph_ops.cc`` at first use.

Inside ``tf.function`` an allreduce is a graph node. As a ``tf.numpy_function`` each node
costs a Python call under the GIL (about 0.1 ms); the compiled op ``HvdGroupedAllreduce``
costs what any TensorFlow op does and hands its tensors to hvd's engine from C++. It is
compiled once per TensorFlow version and source into a cache (``HVD_CACHE_DIR``; else,
in a virtualenv, its ``var/cache/hvd``, removed with it; else ``$XDG_CACHE_HOME/hvd`` or
``~/.cache/hvd``) with the compiler TensorFlow's headers need (``CXX``, else ``c++``),
taking about 15 s; the ranks of a host compile it once, the others wait for it. Where it cannot be built (no compiler, no
headers) or ``HVD_TF_GRAPH_OPS=0`` is set, graphs use ``tf.numpy_function`` nodes instead:
the same results, slower; the reason is warned of once.
"""

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import tensorflow as tf

from hvd import _hvd

_SOURCE = Path(__file__).with_name("graph_ops.cc")


def cache_dir():
    """Where compiled op libraries are kept."""
    if os.environ.get("HVD_CACHE_DIR"):
        return Path(os.environ["HVD_CACHE_DIR"])
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "var" / "cache" / "hvd"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hvd"


def _flags():
    return list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags())


def library_path():
    """The op library's path for this TensorFlow and source (it may not be built yet)."""
    cflags, lflags = _flags()
    key = hashlib.sha256()
    for part in [_SOURCE.read_bytes(), tf.__version__.encode(), sys.version.encode()]:
        key.update(part)
    key.update("\0".join(cflags + lflags).encode())
    return cache_dir() / f"tf_graph_ops-{tf.__version__}-{key.hexdigest()[:16]}.so"


def _compiler():
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler (set CXX, or install g++)")


def build(path):
    """Compiles the op library into ``path``, unless another process has (under a lock, so
    the ranks of one host compile it once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return
        cflags, lflags = _flags()
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        cmd = [_compiler(), "-std=c++17", "-shared", "-fPIC", "-O2", str(_SOURCE), "-o", tmp]
        done = subprocess.run(cmd + cflags + lflags, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"compiling {_SOURCE.name} failed ({' '.join(cmd[:1])}):\n{tail}")
        os.replace(tmp, path)


@functools.cache
def library():
    """The op module (``library().hvd_grouped_allreduce``), built and loaded on first use,
    its entry point set to hvd's native module; None where it cannot be had."""
    if os.environ.get("HVD_TF_GRAPH_OPS", "1") == "0":
        return None
    try:
        path = library_path()
        if not path.exists():
            build(path)
        module = tf.load_op_library(str(path))
        ctypes.CDLL(str(path)).hvd_set_grouped_allreduce(
            ctypes.c_void_p(_hvd.grouped_allreduce_entry()))
        return module
    except Exception as e:  # noqa: BLE001 (any failure leaves the numpy_function path)
        warnings.warn(f"hvd.tensorflow: allreduces inside tf.function run as "
                      f"tf.numpy_function nodes, slower, because hvd's compiled op is not "
                      f"available: {e}", RuntimeWarning, stacklevel=3)
        return None
