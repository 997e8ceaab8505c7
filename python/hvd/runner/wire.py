"""What crosses between ``hvd.run`` and its workers: the pickled function, and results as lines.

The function reaches a worker as an argument of its command line, which every launcher of
``horovodrun`` (local processes, ssh, the agent) passes on; one too long for a command line
goes through a file instead, which only workers on the caller's host (or a shared file system)
can read. A worker's result comes back as marked lines on its standard output, which
``horovodrun`` relays with each line's rank prefix; the caller picks them out.
"""

import base64
import os
import pickle

try:
    import cloudpickle as _pickler
except ImportError:  # closures and lambdas then fail to pickle, as with Horovod
    _pickler = pickle

#: Whether functions are pickled by value (closures, lambdas, functions of ``__main__``).
CLOUDPICKLE = _pickler is not pickle

#: Longest function (base64) passed on the command line. Linux takes up to 128 KiB in one
#: argument, and ssh sends the whole remote command (environment included) as one.
INLINE_LIMIT = 96 * 1024

#: Base64 characters of a result per output line: the agent splits lines over 64 KiB.
CHUNK = 32 * 1024

_MARK = "hvd.run:"


def dumps(obj):
    """Pickles ``obj`` with cloudpickle when it is installed, else with pickle (as Horovod)."""
    return _pickler.dumps(obj)


def function_argument(payload, spill_dir):
    """The worker's argument for the pickled function ``payload``: the bytes themselves, or for
    a payload too long for a command line, a file written in ``spill_dir``."""
    text = base64.b64encode(payload).decode("ascii")
    if len(text) <= INLINE_LIMIT:
        return "inline:" + text
    path = os.path.join(spill_dir, "function.pickle")
    with open(path, "wb") as f:
        f.write(payload)
    return "file:" + path


def load_function(argument):
    """The pickled function an argument of :func:`function_argument` holds.

    Raises ``RuntimeError`` saying why when its file cannot be read here (a remote host)."""
    kind, _, value = argument.partition(":")
    if kind == "inline":
        return base64.b64decode(value)
    if kind == "file":
        try:
            with open(value, "rb") as f:
                return f.read()
        except OSError as e:
            raise RuntimeError(
                f"hvd.run: the function is in {value} on the caller's host, which this worker "
                f"cannot read ({e.strerror}): a function whose pickle is over "
                f"{INLINE_LIMIT * 3 // 4 // 1024} KiB reaches workers through a file, so they "
                "must run on the caller's host or share its file system; capture less in the "
                "function (pass large data as paths)") from None
    raise ValueError(f"hvd.run: not a function argument: {argument[:40]!r}")


def result_lines(nonce, rank, kind, data):
    """The output lines carrying ``data`` (pickled result, or traceback) of ``rank``; ``kind``
    is ``ok`` or ``err``."""
    text = base64.b64encode(data).decode("ascii")
    chunks = [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]
    return [f"{_MARK}{nonce} {rank} {kind} {i} {len(chunks)} {c}\n".encode("ascii")
            for i, c in enumerate(chunks)]


class Collector:
    """Gathers the result lines of one run out of ``horovodrun``'s output, by rank."""

    def __init__(self, nonce):
        self.mark = f"{_MARK}{nonce} ".encode("ascii")
        self.ok = {}
        self.err = {}
        self._parts = {}

    def split(self, line):
        """Takes a result line out of ``line`` (one line of ``horovodrun``'s stdout); returns
        what is left for the user: the line, or the text a worker printed before the mark on
        that line, or ``None``."""
        at = line.find(self.mark)
        if at < 0:
            return line
        head, body = line[:at], line[at + len(self.mark):]
        # What precedes the mark is the relay's prefix, `[label]<stdout>:`, plus any text the
        # worker printed without ending its line; the label tells workers apart.
        start = head.find(b"]<stdout>:")
        label = head[head.rfind(b"[", 0, start) + 1:start] if start >= 0 else b""
        self._add(label, body.split())
        own = head[start + len(b"]<stdout>:"):] if start >= 0 else head
        return head + b"\n" if own.strip() else None

    def _add(self, label, fields):
        if len(fields) not in (4, 5):
            return
        rank, kind, i, n = int(fields[0]), fields[1].decode(), int(fields[2]), int(fields[3])
        chunk = fields[4] if len(fields) == 5 else b""
        key = (label, rank, kind)
        parts = self._parts.setdefault(key, [])
        if i == 0:
            parts.clear()
        parts.append(chunk)
        if i == n - 1 and len(parts) == n:
            data = base64.b64decode(b"".join(parts))
            del self._parts[key]
            (self.ok if kind == "ok" else self.err)[rank] = data


def strip_output_files(directory, nonce):
    """Removes the result lines from the per-rank output files ``horovodrun`` wrote under
    ``directory`` (``--output-filename``): they hold what the workers printed, as Horovod's."""
    collector = Collector(nonce)
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry, "stdout")
        try:
            with open(path, "rb") as f:
                lines = f.readlines()
        except OSError:
            continue
        if not any(collector.mark in line for line in lines):
            continue
        kept = []
        for line in lines:
            at = line.find(collector.mark)
            if at < 0:
                kept.append(line)
            elif line[:at].strip():
                kept.append(line[:at] + b"\n")
        with open(path, "wb") as f:
            f.writelines(kept)
