"""The worker side of ``hvd.run``: ``python -m hvd.runner.task NONCE FUNCTION``.

Runs the pickled function with its arguments and writes its pickled return value, or the
traceback of what it raised, as result lines on standard output (see :mod:`hvd.runner.wire`).
"""

import os
import pickle
import sys
import traceback

from hvd.runner import wire


def _rank():
    """This worker's rank: the job's when the function left hvd initialized (an elastic job's
    rank changes as it runs), else the one ``horovodrun`` started it with."""
    try:
        from hvd import _hvd

        if _hvd.is_initialized():
            return _hvd.topology()[0]
    except Exception:  # no job joined: the rank it was started with
        pass
    return int(os.environ.get("HOROVOD_RANK", "0"))


def _emit(nonce, kind, data):
    """Writes result lines straight to the stdout file, after what the function printed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a stream the function closed or replaced
            pass
    for line in wire.result_lines(nonce, _rank(), kind, data):
        while line:
            line = line[os.write(1, line):]


def main(argv):
    """Runs the function ``argv`` carries; returns the process's exit code."""
    if len(argv) != 2:
        sys.stderr.write("usage: python -m hvd.runner.task NONCE FUNCTION (started by hvd.run)\n")
        return 64
    nonce, argument = argv
    try:
        func, args, kwargs = pickle.loads(wire.load_function(argument))
        value = wire.dumps(func(*args, **kwargs))
    except BaseException as e:  # noqa: B036 (SystemExit too: the caller must hear of it)
        # The traceback from the function's frame on: this module's frame says nothing.
        tb = e.__traceback__.tb_next or e.__traceback__
        text = "".join(traceback.format_exception(type(e), e, tb))
        sys.stderr.write(text)
        _emit(nonce, "err", text.encode("utf-8", "replace"))
        return 1
    _emit(nonce, "ok", value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
