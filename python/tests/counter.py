"""The elastic counter's events and checks, shared by the framework programs that print them
(``elastic_train.py`` for PyTorch, ``keras_elastic_train.py`` for Keras): JSON lines ``start``,
``reset``, ``step``, ``commit`` and ``done``, as Rust's ``elastic_counter`` prints them, read
by the tests and ``elastic_bench``.

The state holds ``step``, ``total`` (the sum of the world's size over the steps) and
``history`` (the sizes); every step's model update moves one weight by exactly one, so at the
end ``total`` is the sum of ``history`` and the weight is ``-steps`` on every rank.
"""

import argparse
import json
import os
import time


def emit(event):
    """Prints one event as a JSON line, at once."""
    print(json.dumps(event, separators=(",", ":")), flush=True)


def parser(description):
    """The counter's flags (``elastic_bench`` passes ``--steps``, ``--commit-every`` and
    ``--step-ms``), for a program to add its own to."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--step-ms", type=float, default=10)
    p.add_argument("--gil-busy-at-step", type=int, default=None,
                   help="after this step, compute in pure Python for --gil-busy-ms, holding "
                        "the GIL: a long step the driver must tell from a frozen process")
    p.add_argument("--gil-busy-ms", type=float, default=0)
    return p


def start():
    """The ``start`` event, with what horovodrun told this worker."""
    emit({"event": "start", "horovod": {k: os.environ.get("HOROVOD_" + k.upper()) for k in
                                        ("rank", "size", "local_rank", "hostname")}})


def entered(calls, state, rank, size):
    """Counts a call of the elastic function; every call after the first is a ``reset``."""
    calls[0] += 1
    if calls[0] > 1:
        emit({"event": "reset", "step": state.step, "rank": rank, "size": size})


def take_batch(sampler, samples):
    """Records this rank's next 2 samples of the epoch as processed (every rank takes as
    many), starting the next epoch once all ``samples`` are: what an ``ElasticSampler`` in the
    state goes through in training."""
    sampler.record_indices(list(sampler)[:2])
    if sampler.processed_num >= samples:
        sampler.set_epoch(sampler.epoch + 1)


def stepped(state, rank, size):
    """Counts a training step taken at ``size``."""
    state.total += size
    state.history.append(size)
    state.step += 1
    emit({"event": "step", "step": state.step, "rank": rank, "size": size,
          "total": state.total})


def commit_or_check(state, args, rank):
    """Commits every ``--commit-every`` steps, checks for host updates at the others, then
    waits ``--step-ms``."""
    if state.step % args.commit_every == 0:
        state.commit()
        emit({"event": "commit", "step": state.step, "rank": rank})
    else:
        state.check_host_updates()
    if getattr(args, "gil_busy_at_step", None) == state.step:
        emit({"event": "busy", "step": state.step, "rank": rank})
        end = time.monotonic() + args.gil_busy_ms / 1000
        spins = 0
        while time.monotonic() < end:
            spins += 1
    time.sleep(args.step_ms / 1000)


def done(state, weight, rank, size, resets, steps):
    """Checks the counter and the weight at the end, and emits ``done``."""
    history_sum = sum(state.history)
    if state.total != history_sum or len(state.history) != steps or weight != -steps:
        raise SystemExit(f"rank {rank}: total {state.total}, history sums to {history_sum} over "
                         f"{len(state.history)} steps, weight {weight} (expected {-steps})")
    emit({"event": "done", "rank": rank, "size": size, "steps": steps, "total": state.total,
          "history_sum": history_sum, "weight": weight, "resets": resets})
