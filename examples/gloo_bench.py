#!/usr/bin/env python3
"""PyTorch Gloo allreduce baseline, for comparison with hvd's allreduce benchmark.

What it is
    An nccl-tests ``all_reduce_perf``-style sweep of torch.distributed's Gloo
    backend on one machine: float32 SUM allreduce over N local processes that
    rendezvous on 127.0.0.1 (a free TCP port picked at runtime).  For each size,
    doubling from --min-bytes to --max-bytes, every rank runs --warmup warm-up
    iterations, then --iters timed iterations.  Before each timed iteration all
    ranks pass a barrier; each rank times only its own all_reduce call
    (time.perf_counter), and per iteration the MAX over ranks is taken (an
    element-wise MAX allreduce of the per-iteration times after the loop).  The
    MEDIAN of those per-iteration maxima is reported.  The same --iters count is
    used for every size (large sizes are not cut short; lower --iters yourself
    for quick runs).

        algbw = size_bytes / time            (GB/s, 1 GB = 1e9 bytes)
        busbw = algbw * 2 * (n - 1) / n      (as nccl-tests reports allreduce)

    Every rank fills its tensor with rank+1 before every iteration and checks
    that the result is n(n+1)/2 everywhere after it; on a wrong result the
    program prints an error and exits 1.

Installing torch for it (CPU-only machine, Python 3.11, PyPI only)
    PyPI's Linux torch wheel is a CUDA build: libtorch links the CUDA runtime
    libraries, so ``import torch`` fails without them even on a CPU-only box
    (``libcudart.so.13: cannot open shared object file``).  The leanest
    working install found (torch 2.15.0) skips triton, cusolver, cuda-bindings,
    nvtx and cccl (~0.5 GB of wheels) and installs only the libraries that are
    linked at load time, pinned in ``python/requirements-test.txt`` (the
    tests install the same set into ``target/pyenv``):

        pip install --no-deps -r python/requirements-test.txt

    About 4 GB on disk (torch 1.2 GB, nvidia libs 2.8 GB); ~50 s on a fast
    link.  A plain ``pip install torch==2.15.0`` also works, only bigger.
    numpy is not needed (torch warns once that it is missing; that warning is
    silenced here).

Running it
    python3 examples/gloo_bench.py --np 2
    python3 examples/gloo_bench.py --np 4 --min-bytes 67108864 --max-bytes 67108864
    python3 examples/gloo_bench.py --np 2 --min-bytes 4 --max-bytes 4 --iters 50 --json

    Options: --np N (processes, required), --min-bytes B (default 4),
    --max-bytes B (default 268435456 = 256 MiB), --iters K (timed, default 20),
    --warmup W (default 5), --json (one JSON object per line per size instead
    of the table), --timeout S (whole run, default 900 s; also the Gloo
    collective timeout).  Exit status: 0 ok, 1 wrong result or a worker
    failed, 2 bad arguments, 124 timeout.

    Each worker runs with OMP_NUM_THREADS=1 / torch.set_num_threads(1) and
    GLOO_SOCKET_IFNAME=lo (unless already set).  Workers are killed when the
    launcher exits or is killed (PR_SET_PDEATHSIG), so no process is orphaned.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

EXIT_WRONG = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="torch.distributed Gloo allreduce benchmark (nccl-tests style)"
    )
    p.add_argument("--np", type=int, required=True, help="number of local processes")
    p.add_argument("--min-bytes", type=int, default=4)
    p.add_argument("--max-bytes", type=int, default=256 * 1024 * 1024)
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("--warmup", type=int, default=5, help="warm-up iterations per size")
    p.add_argument("--json", action="store_true", help="one JSON object per line per size")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    # Testing aid: rank 0 corrupts its result once, to prove the check fails the run.
    p.add_argument("--corrupt-for-test", action="store_true", help=argparse.SUPPRESS)
    # Internal: set by the launcher on the worker processes.
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.np < 1:
        p.error("--np must be >= 1")
    if a.min_bytes < 4 or a.max_bytes < a.min_bytes:
        p.error("need 4 <= --min-bytes <= --max-bytes")
    if a.iters < 1 or a.warmup < 0:
        p.error("need --iters >= 1 and --warmup >= 0")
    if a.timeout <= 0:
        p.error("--timeout must be > 0")
    return a


def sizes(min_bytes, max_bytes):
    s = min_bytes
    while s <= max_bytes:
        yield s
        s *= 2


# ----------------------------------------------------------------------------
# worker


def _die_with_parent():
    """Linux: get SIGKILL if the launcher dies, so workers are never orphaned."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() == 1:  # parent already gone
            os._exit(EXIT_WRONG)
    except Exception:
        pass


def worker(a):
    _die_with_parent()
    import datetime
    import warnings

    warnings.filterwarnings("ignore", message=".*NumPy.*")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    n = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        backend="gloo",
        rank=rank,
        world_size=n,
        timeout=datetime.timedelta(seconds=a.timeout),
    )
    expected = float(n * (n + 1) // 2)
    wrong = False
    busfactor = 2.0 * (n - 1) / n

    if rank == 0 and not a.json:
        print(
            f"# gloo allreduce  torch {torch.__version__}  np={n}  dtype=float32 op=sum  "
            f"warmup={a.warmup} iters={a.iters}\n"
            "# time = median over iterations of the max over ranks of one all_reduce call\n"
            f"# {'size(B)':>12} {'count':>12} {'time(us)':>12} {'algbw(GB/s)':>12} "
            f"{'busbw(GB/s)':>12}",
            flush=True,
        )

    for size in sizes(a.min_bytes, a.max_bytes):
        count = max(1, size // 4)
        nbytes = count * 4
        t = torch.empty(count, dtype=torch.float32)
        times = torch.zeros(a.iters, dtype=torch.float64)
        bad = 0
        for it in range(a.warmup + a.iters):
            t.fill_(float(rank + 1))
            timed = it >= a.warmup
            if timed:
                dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            t1 = time.perf_counter()
            if timed:
                times[it - a.warmup] = t1 - t0
            if a.corrupt_for_test and rank == 0 and it == 0:
                t[count // 2] += 1.0
            if not bool(torch.all(t == expected)):
                bad += 1
        # per-iteration max over ranks, and whether any rank saw a wrong result
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        flag = torch.tensor([bad], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        if rank == 0:
            sec = statistics.median(times.tolist())
            algbw = nbytes / sec / 1e9
            busbw = algbw * busfactor
            if a.json:
                print(
                    json.dumps(
                        {
                            "size": nbytes,
                            "count": count,
                            "time_us": float(f"{sec * 1e6:.6g}"),
                            "algbw_gbps": float(f"{algbw:.6g}"),
                            "busbw_gbps": float(f"{busbw:.6g}"),
                            "np": n,
                            "impl": "gloo",
                        }
                    ),
                    flush=True,
                )
            else:
                print(
                    f"  {nbytes:>12} {count:>12} {sec * 1e6:>12.1f} {algbw:>12.4f} "
                    f"{busbw:>12.4f}",
                    flush=True,
                )
            if flag.item():
                print(
                    f"gloo_bench: WRONG RESULT at size {nbytes}: {flag.item()} "
                    f"rank-iterations differ from expected {expected}",
                    file=sys.stderr,
                    flush=True,
                )
        if flag.item():
            wrong = True
            break
        del t

    dist.barrier()
    dist.destroy_process_group()
    return EXIT_WRONG if wrong else 0


# ----------------------------------------------------------------------------
# launcher


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            try:
                p.terminate()
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(a, argv):
    port = free_port()
    base = dict(os.environ)
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(a.np),
        OMP_NUM_THREADS="1",
    )
    base.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--_worker"]
    procs = []

    def on_signal(signum, _frame):
        kill_all(procs)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    for r in range(a.np):
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen(cmd, env=env))

    deadline = time.monotonic() + a.timeout
    rc = 0
    try:
        pending = list(procs)
        while pending:
            for p in list(pending):
                code = p.poll()
                if code is None:
                    continue
                pending.remove(p)
                if code != 0:
                    rc = code if code > 0 else EXIT_WRONG
                    print(
                        f"gloo_bench: worker pid {p.pid} exited with {code}; stopping the rest",
                        file=sys.stderr,
                    )
                    kill_all(pending)
                    pending = []
                    break
            if pending and time.monotonic() > deadline:
                print(f"gloo_bench: timed out after {a.timeout:.0f}s", file=sys.stderr)
                kill_all(pending)
                return EXIT_TIMEOUT
            time.sleep(0.05)
    finally:
        kill_all(procs)
    return rc


def main():
    argv = sys.argv[1:]
    a = parse_args(argv)
    if a._worker:
        return worker(a)
    return launch(a, argv)


if __name__ == "__main__":
    sys.exit(main())
