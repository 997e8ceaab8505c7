"""``hvd.run`` end to end, one case a run: ``python run.py CASE [ARG]`` prints ``run ok: CASE``.

``horovodrun`` is the one ``HVD_HOROVODRUN`` names. Cases: ``ranks`` (results in rank order
for 1 to 3 ranks, with args and kwargs, output echoed without the result lines), ``closure``
(a lambda and a closure, pickled by value), ``torch`` (a function that joins the job and
allreduces), ``raises`` (one rank's exception), ``refused`` (MPI, and other bad arguments),
``elastic SCRIPT`` (an elastic job over the hosts the discovery script prints).
"""

import os
import subprocess
import sys
import tempfile

import hvd
import hvd.runner


def rank_and_args(base, scale=1):
    """Returns its rank and arguments; prints a line, and a partial one, as a function may."""
    rank = int(os.environ["HOROVOD_RANK"])
    print(f"printed by rank {rank}")
    print(f"unended by rank {rank}", end="")
    return rank, base * scale


def case_ranks():
    assert hvd.runner.run is hvd.run
    for np in (1, 2, 3):
        got = hvd.run(rank_and_args, args=(10,), kwargs={"scale": 3}, num_proc=np)
        assert got == [(r, 30) for r in range(np)], got
    # --output-filename's files hold what each rank printed, without the result lines.
    with tempfile.TemporaryDirectory() as logs:
        hvd.run(rank_and_args, args=(1,), num_proc=2, output_filename=logs)
        for r in range(2):
            with open(os.path.join(logs, f"rank.{r}", "stdout")) as f:
                text = f.read()
            assert text == f"printed by rank {r}\nunended by rank {r}\n", text
    # Horovod's deprecated spelling still works.
    assert hvd.run(rank_and_args, args=(1,), np=2) == [(0, 1), (1, 1)]
    # The caller never needed torch.
    assert "torch" not in sys.modules, "hvd.run imported torch"


def case_closure():
    factor = 7
    got = hvd.run(lambda x: x * factor + int(os.environ["HOROVOD_RANK"]), args=(2,), num_proc=2)
    assert got == [14, 15], got

    def make_counter(start):
        def count(n):
            return [start + i for i in range(n)]
        return count

    assert hvd.run(make_counter(5), args=(3,), num_proc=2) == [[5, 6, 7]] * 2
    # A function whose pickle is too long for a command line goes through a file, and a
    # result longer than an output line comes back in pieces.
    table = bytes(range(256)) * 1024
    got = hvd.run(lambda: (len(table), table[::-1]), num_proc=2)
    assert got == [(len(table), table[::-1])] * 2


def allreduce_rank():
    import torch

    import hvd.torch as hvd_torch

    hvd_torch.init()
    t = torch.arange(4, dtype=torch.float32) * (hvd_torch.rank() + 1)
    return hvd_torch.allreduce(t, op=hvd_torch.Sum, name="rank_sum"), hvd_torch.size()


def case_torch():
    import torch

    for np in (2, 3):
        got = hvd.run(allreduce_rank, num_proc=np)
        expected = torch.arange(4, dtype=torch.float32) * sum(range(1, np + 1))
        assert len(got) == np, got
        for tensor, size in got:
            assert isinstance(tensor, torch.Tensor) and torch.equal(tensor, expected), got
            assert size == np, got


def fail_on_rank_1():
    if os.environ["HOROVOD_RANK"] == "1":
        raise ValueError("no good on rank 1")
    return "fine"


def case_raises():
    try:
        hvd.run(fail_on_rank_1, num_proc=2)
    except RuntimeError as e:
        text = str(e)
    else:
        raise AssertionError("no RuntimeError")
    assert "failed on rank 1" in text, text
    assert "Traceback" in text and "ValueError: no good on rank 1" in text, text
    assert "fail_on_rank_1" in text, text


def refused(expected_type, func=rank_and_args, **kwargs):
    """The message of the error ``hvd.run`` raises for ``func`` and ``kwargs``."""
    try:
        hvd.run(func, args=(1,), **kwargs)
    except expected_type as e:
        return str(e)
    raise AssertionError(f"{kwargs}: no {expected_type.__name__}")


def horovodrun_says(*flags):
    """What ``horovodrun`` prints when it refuses ``flags``: the text hvd.run must pass on."""
    out = subprocess.run([os.environ["HVD_HOROVODRUN"], *flags, "true"], capture_output=True,
                         text=True)
    assert out.returncode == 64, out
    return out.stderr.strip().removeprefix("horovodrun: error: ")


def case_refused():
    for kwargs, flag in ((dict(use_mpi=True), "--mpi"),
                         (dict(mpi_args="--map-by ppr:2:node"), "--mpi-args=-x")):
        text = refused(ValueError, **kwargs)
        name = next(iter(kwargs))
        assert horovodrun_says(flag) in text and f"argument {name}" in text, text
    text = refused(ValueError, num_proc=0)
    assert "argument num_proc" in text and "at least 1" in text, text
    text = refused(ValueError, hosts="localhost:1", hostfile="hosts.txt")
    assert "--hosts" in text and "--hostfile" in text, text
    assert "cooldown_range" in refused(ValueError, cooldown_range=5)
    assert "callable" in refused(TypeError, func=42)
    saved = dict(os.environ)
    os.environ["HVD_HOROVODRUN"] = "/nonexistent/horovodrun"
    assert "/nonexistent/horovodrun" in refused(FileNotFoundError)
    del os.environ["HVD_HOROVODRUN"]
    os.environ["PATH"] = "/nonexistent"
    assert "cargo build --release -p hvd-driver" in refused(FileNotFoundError)
    os.environ.update(saved)
    # Switches given as False are not given: Horovod's example passes use_mpi=False.
    assert hvd.run(rank_and_args, args=(2,), use_gloo=False, use_mpi=False) == [(0, 2)]


def train_elastic(steps):
    import torch

    import hvd.torch as hvd_torch

    hvd_torch.init()
    total = torch.zeros(1)
    for _ in range(steps):
        total += hvd_torch.allreduce(torch.ones(1), op=hvd_torch.Sum, name="count")
    return hvd_torch.rank(), hvd_torch.size(), total.item()


def case_elastic(script):
    got = hvd.run(train_elastic, args=(5,), num_proc=3, min_num_proc=2, max_num_proc=3,
                  slots=2, reset_limit=1, host_discovery_script=script)
    # Horovod returns the first min_num_proc ranks' values, in rank order.
    assert got == [(0, 3, 15.0), (1, 3, 15.0)], got


if __name__ == "__main__":
    case, extra = sys.argv[1], sys.argv[2:]
    globals()[f"case_{case}"](*extra)
    print(f"run ok: {case}", flush=True)
