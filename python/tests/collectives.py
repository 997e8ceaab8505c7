"""Every collective of ``hvd.torch`` against a reference computed here, run under
``horovodrun -np N`` (1 to 4 ranks). Every rank builds every rank's input from
(rank, case) alone, so each can compute the expected result itself.

Prints ``collectives ok: rank R of N, C cases`` and exits 0, or raises.
"""

import os
import sys

import torch

import hvd.torch as hvd

DTYPES = [torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]
OPS = {hvd.Sum: "sum", hvd.Average: "average", hvd.Min: "min", hvd.Max: "max",
       hvd.Product: "product"}
# Element counts on both sides of the 32 KiB threshold between the small-call and ring paths.
COUNTS = [0, 1, 7, 1000, 20000]


def data(rank, case, count, dtype):
    """Rank ``rank``'s input of case ``case``: small values, so products stay exact."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    v = torch.randint(1, 4, (count,), generator=g)
    return v.to(dtype)


def reference(inputs, op, dtype):
    """The reduction of ``inputs``, computed in float64 (ints in int64), then cast."""
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    xs = torch.stack([x.to(wide) for x in inputs])
    if op == "sum":
        r = xs.sum(0)
    elif op == "average":
        r = xs.sum(0) / len(inputs)
        if not dtype.is_floating_point:
            r = torch.trunc(r)
    elif op == "min":
        r = xs.min(0).values
    elif op == "max":
        r = xs.max(0).values
    else:
        r = xs.prod(0)
    return r.to(dtype)


def close(got, want, dtype):
    if dtype in (torch.float16, torch.bfloat16):
        return torch.allclose(got.double(), want.double(), rtol=1e-2, atol=1e-2)
    if dtype.is_floating_point:
        return torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    return torch.equal(got, want)


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert 0 <= hvd.local_rank() < hvd.local_size() <= n
    assert 0 <= hvd.cross_rank() < hvd.cross_size() <= n
    assert hvd.is_initialized() and hvd.gloo_built() and not hvd.nccl_built()
    cases = 0
    case = 0
    for dtype in DTYPES:
        for op, name in OPS.items():
            if name == "product" and dtype in (torch.uint8, torch.float16, torch.bfloat16):
                counts = [1, 7]  # 3^4 overflows a byte and loses half precision past 2^11
            else:
                counts = COUNTS
            for count in counts:
                case += 1
                inputs = [data(p, case, count, dtype) for p in range(n)]
                want = reference(inputs, name, dtype)
                mine = inputs[r].clone()
                got = hvd.allreduce(mine, op=op)
                assert torch.equal(mine, inputs[r]), "allreduce changed its input"
                assert got.dtype == dtype and got.shape == mine.shape
                assert close(got, want, dtype), (dtype, name, count, got[:8], want[:8])
                again = inputs[r].clone()
                assert hvd.allreduce_(again, op=op) is again
                assert close(again, want, dtype), (dtype, name, count, "in place")
                cases += 1
        for root in range(n):
            case += 1
            inputs = [data(p, case, 1000, dtype) for p in range(n)]
            got = hvd.broadcast(inputs[r], root)
            assert torch.equal(got, inputs[root]), (dtype, root)
            cases += 1

    # A non-contiguous tensor is reduced in place through a contiguous copy.
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (r + 1)
    col = m[:, 1]
    assert not col.is_contiguous()
    hvd.allreduce_(col, op=hvd.Sum)
    tri = n * (n + 1) // 2
    assert torch.equal(m[:, 1], torch.tensor([1.0, 5.0, 9.0]) * tri), m
    assert torch.equal(m[:, 0], torch.tensor([0.0, 4.0, 8.0]) * (r + 1)), "other columns kept"

    # Pre- and postscaling, and the deprecated ``average`` flag.
    x = torch.ones(5, dtype=torch.float64)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.equal(got, torch.full((5,), float(n), dtype=torch.float64)), got
    assert torch.equal(hvd.allreduce(x, average=False), torch.full((5,), float(n),
                                                                      dtype=torch.float64))
    assert torch.equal(hvd.allreduce(x), x), "the default op is the average"

    # broadcast_parameters: every rank ends with rank 0's parameters.
    torch.manual_seed(r)
    model = torch.nn.Linear(4, 3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(0)
    expected = torch.nn.Linear(4, 3)
    for (k, a), (_, b) in zip(model.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(a, b), k

    # Clear errors, and no collective is left half done by them.
    for bad, what in [(lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)), "dtype bool"),
                      (lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32),
                                             op=hvd.Adasum), "floating-point"),
                      (lambda: hvd.reducescatter(torch.ones(2), op=hvd.Adasum),
                       "Adasum is an allreduce only"),
                      (lambda: hvd.allreduce([1.0]), "torch.Tensor"),
                      (lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32),
                                             prescale_factor=2.0), "floating-point")]:
        try:
            bad()
        except (ValueError, TypeError, NotImplementedError) as e:
            assert what in str(e), (what, str(e))
        else:
            raise AssertionError(f"no error for {what}")

    # A length that differs between ranks fails on every rank, naming it, and the next
    # collective works.
    if n > 1:
        try:
            hvd.allreduce(torch.ones(3 + r))
        except RuntimeError as e:
            assert "length" in str(e) or "mismatch" in str(e), str(e)
        else:
            raise AssertionError("a length mismatch between ranks went through")
        assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))

    # allgather: first dimensions that differ per rank, every dtype.
    for dtype in DTYPES:
        case += 1
        parts = [data(p, case, 3 * (p + 1), dtype).reshape(p + 1, 3) for p in range(n)]
        got = hvd.allgather(parts[r])
        assert torch.equal(got, torch.cat(parts)), (dtype, got.shape)
        got = hvd.synchronize(hvd.allgather_async(parts[r], name=f"allgather.{case}"))
        assert torch.equal(got, torch.cat(parts)), ("async", dtype, got.shape)
        cases += 1
    assert hvd.allgather_object({"rank": r}) == [{"rank": p} for p in range(n)]
    # alltoall: rank p sends (p + q) % 3 rows to rank q.
    for dtype in DTYPES:
        case += 1
        sends = {p: [(p + q) % 3 for q in range(n)] for p in range(n)}
        inputs = {p: data(p, case, 2 * sum(sends[p]), dtype).reshape(-1, 2) for p in range(n)}
        out, received = hvd.alltoall(inputs[r], splits=sends[r])
        want = []
        for p in range(n):
            start = sum(sends[p][:r])
            want.append(inputs[p][start:start + sends[p][r]])
        assert torch.equal(out, torch.cat(want)), (dtype, out, want)
        assert received.tolist() == [sends[p][r] for p in range(n)]
        out, received = hvd.synchronize(hvd.alltoall_async(inputs[r], splits=sends[r]))
        assert torch.equal(out, torch.cat(want)), ("async", dtype, out, want)
        assert received.tolist() == [sends[p][r] for p in range(n)], ("async", received)
        cases += 1
    even, _ = hvd.alltoall(torch.arange(2 * n, dtype=torch.int32) + 100 * r)
    assert even.tolist() == [100 * p + 2 * r + k for p in range(n) for k in range(2)], even
    # reducescatter: this rank's rows of the reduction, every dtype and op, row counts below,
    # at and past a multiple of the ranks; the first rows % n ranks get one row more.
    for dtype in DTYPES:
        for op, name in OPS.items():
            for rows in (1, n, n + 1, 3 * n + 2):
                if name == "product" and rows > n + 1:
                    continue  # one case of each shape is enough for the products' overflow
                case += 1
                inputs = [data(p, case, rows * 6, dtype).reshape(rows, 2, 3) for p in range(n)]
                want = reference([i.flatten() for i in inputs], name, dtype).reshape(rows, 2, 3)
                got = hvd.reducescatter(inputs[r], op=op)
                base, extra = divmod(rows, n)
                start = r * base + min(r, extra)
                mine = want[start:start + base + (1 if r < extra else 0)]
                assert got.shape == mine.shape, (dtype, name, rows, got.shape, mine.shape)
                assert close(got.flatten(), mine.flatten(), dtype), (dtype, name, rows)
                got = hvd.synchronize(hvd.reducescatter_async(inputs[r], op=op))
                assert got.shape == mine.shape, ("async", dtype, name, rows, got.shape)
                assert close(got.flatten(), mine.flatten(), dtype), ("async", dtype, name, rows)
                cases += 1
    x = torch.ones(2 * n, 3)
    got = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert torch.equal(got, torch.full((2, 3), n / 2.0)), got
    assert torch.equal(x, torch.ones(2 * n, 3)), "reducescatter changed its input"
    # The three in flight together with an allreduce, waited for in another order.
    handles = [hvd.allgather_async(torch.full((r + 1, 2), float(r))),
               hvd.alltoall_async(torch.full((n,), float(r))),
               hvd.reducescatter_async(x, op=hvd.Sum, prescale_factor=2.0,
                                       postscale_factor=0.25),
               hvd.allreduce_async(torch.ones(3), op=hvd.Sum)]
    assert all(isinstance(hvd.poll(h), bool) for h in handles)
    summed = hvd.synchronize(handles[3])
    assert torch.equal(summed, torch.full((3,), float(n))), summed
    scattered = hvd.synchronize(handles[2])
    assert torch.equal(scattered, torch.full((2, 3), n / 2.0)), scattered
    out, received = hvd.synchronize(handles[1])
    assert torch.equal(out, torch.arange(n, dtype=torch.float32)), out
    assert received.tolist() == [1] * n, received
    gathered = hvd.synchronize(handles[0])
    assert torch.equal(gathered, torch.cat([torch.full((p + 1, 2), float(p))
                                            for p in range(n)])), gathered

    # Asynchronous ops through the background engine: many in flight at once, fused.
    case += 1
    tensors = {dt: [data(p, case + k, 500 + 37 * k, dt) for p in range(n)]
               for k, dt in enumerate(DTYPES)}
    handles = {}
    for dt, inputs in tensors.items():
        handles[dt] = hvd.allreduce_async_(inputs[r].clone(), op=hvd.Sum, name=f"a.{dt}")
    for dt, h in handles.items():
        while not hvd.poll(h):
            pass
        got = hvd.synchronize(h)
        assert close(got, reference(tensors[dt], "sum", dt), dt), ("async", dt)
        cases += 1
    try:
        hvd.synchronize(handles[torch.float32])
    except ValueError as e:
        assert "already synchronized" in str(e), str(e)
    else:
        raise AssertionError("a handle synchronized twice")
    x = torch.full((10,), float(r + 1))
    h = hvd.allreduce_async(x, postscale_factor=2.0)
    assert torch.equal(hvd.synchronize(h), torch.full((10,), (n + 1.0))), "average x2"
    assert torch.equal(x, torch.full((10,), float(r + 1))), "allreduce_async kept its input"
    m = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    col = m[:, 2]
    hvd.synchronize(hvd.allreduce_async_(col, op=hvd.Sum))
    assert torch.equal(m[:, 2], torch.tensor([2.0, 6.0, 10.0], dtype=torch.float64) * n)
    group = [torch.full((k + 1,), float(r + k)) for k in range(20)]
    outs = hvd.grouped_allreduce(group, op=hvd.Sum)
    for k, o in enumerate(outs):
        assert torch.equal(o, torch.full((k + 1,), float(n * (n - 1) // 2 + n * k))), k
    b = hvd.synchronize(hvd.broadcast_async(torch.full((3,), float(r)), root_rank=n - 1))
    assert torch.equal(b, torch.full((3,), float(n - 1)))
    # Synchronous calls go on working while the engine holds the communicator.
    assert torch.equal(hvd.allreduce(torch.ones(4), op=hvd.Sum), torch.full((4,), float(n)))
    cases += 5

    # allreduce is differentiable: the gradient is the same allreduce of the output's.
    w = torch.full((3,), float(r + 1), requires_grad=True)
    (hvd.allreduce(w, op=hvd.Sum) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(w.grad, torch.tensor([1.0, 2.0, 3.0]) * n), w.grad
    w.grad = None
    hvd.allreduce(w).sum().backward()
    assert torch.equal(w.grad, torch.ones(3)), w.grad
    cases += 1

    # join: rank p runs p + 1 steps, then joins; a joined rank counts as zeros in the others'
    # allreduces (unnamed async ones and synchronous ones alike), and every rank learns the
    # rank that joined last. Afterwards generated names line up again.
    for step in range(r + 1):
        live = sum(1 for p in range(n) if p + 1 > step)
        got = hvd.synchronize(hvd.allreduce_async(torch.ones(3, dtype=torch.float64),
                                                  op=hvd.Sum))
        assert torch.equal(got, torch.full((3,), float(live), dtype=torch.float64)), (step, got)
        got = hvd.allreduce(torch.full((2,), 4.0))
        assert torch.equal(got, torch.full((2,), 4.0 * live / n)), ("average", step, got)
    assert hvd.join() == n - 1
    got = hvd.synchronize(hvd.allreduce_async(torch.ones(1), op=hvd.Sum))
    assert torch.equal(got, torch.full((1,), float(n))), got
    assert torch.equal(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(n)))
    cases += 1

    # The timeline, started and stopped while running: every rank's ops are in one trace,
    # and nothing after the stop.
    import json
    import tempfile
    trace = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(), "timeline.json")
                                 if r == 0 else None)
    hvd.start_timeline(trace, mark_cycles=True)
    hvd.synchronize(hvd.allreduce_async(torch.ones(8), name="traced"))
    hvd.stop_timeline()
    hvd.synchronize(hvd.allreduce_async(torch.ones(8), name="untraced"))
    hvd.barrier()
    if r == 0:
        with open(trace) as f:
            events = json.loads(f.read().rstrip().rstrip(",") + "]")
        rows = {(e["pid"], e["tid"]) for e in events}
        assert all((p, "traced") in rows for p in range(n)), sorted(rows)
        assert not any(e["tid"] == "untraced" for e in events), "recorded after the stop"
        assert any(e["name"] == "CYCLE" for e in events), "cycles not marked"
        os.remove(trace)
        os.rmdir(os.path.dirname(trace))
    try:
        hvd.start_timeline("/nonexistent-dir/timeline.json")
    except RuntimeError as e:
        assert "/nonexistent-dir/timeline.json" in str(e), str(e)
    else:
        raise AssertionError("a timeline in a missing directory started")
    cases += 1

    # Process sets: the even ranks, and (with two ranks or more) the odd ones. Adding one
    # while the background engine runs stops it first.
    even = hvd.add_process_set([p for p in range(n) if p % 2 == 0])
    odd = hvd.add_process_set([p for p in range(n) if p % 2 == 1]) if n > 1 else None
    mine, other = (even, odd) if r % 2 == 0 else (odd, even)
    assert mine.included() and mine.size() == len(mine.ranks)
    got = hvd.allreduce(torch.ones(3), op=hvd.Sum, process_set=mine)
    assert torch.equal(got, torch.full((3,), float(mine.size()))), got
    avg = hvd.allreduce(torch.full((2,), float(r)), process_set=mine)
    assert torch.equal(avg, torch.full((2,), sum(mine.ranks) / mine.size())), avg
    b = hvd.broadcast(torch.full((4,), float(r)), root_rank=mine.ranks[-1], process_set=mine)
    assert torch.equal(b, torch.full((4,), float(mine.ranks[-1]))), b
    h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, process_set=mine)
    assert hvd.poll(h) and torch.equal(hvd.synchronize(h), torch.full((2,), float(mine.size())))
    if other is not None:
        assert not other.included()
        try:
            hvd.allreduce(torch.ones(1), process_set=other)
        except RuntimeError as e:
            assert "process set" in str(e), str(e)
        else:
            raise AssertionError("a collective on a set this rank is not in went through")
    # Every collective takes process_set=.
    k, m = mine.rank(), mine.size()
    got = hvd.allgather(torch.full((k + 1, 2), float(r)), process_set=mine)
    want = torch.cat([torch.full((q + 1, 2), float(p)) for q, p in enumerate(mine.ranks)])
    assert torch.equal(got, want), got
    assert hvd.allgather_object(r, process_set=mine) == mine.ranks
    out, received = hvd.alltoall(torch.full((m,), float(r)), process_set=mine)
    assert torch.equal(out, torch.tensor([float(p) for p in mine.ranks])), out
    assert received.tolist() == [1] * m
    got = hvd.reducescatter(torch.ones(m + 1, 2), op=hvd.Sum, process_set=mine)
    assert torch.equal(got, torch.full((2 if k == 0 else 1, 2), float(m))), got
    assert hvd.broadcast_object(f"from {mine.ranks[0]}", root_rank=mine.ranks[0],
                                process_set=mine) == f"from {mine.ranks[0]}"
    hvd.barrier(process_set=mine)
    cases += 1

    # The whole job's collectives and the engine go on beside the sets.
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
    h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum)
    assert torch.equal(hvd.synchronize(h), torch.full((2,), float(n)))
    hvd.remove_process_set(even)
    try:
        hvd.allreduce(torch.ones(1), process_set=even)
    except ValueError as e:
        assert "not an added process set" in str(e), str(e)
    else:
        raise AssertionError("a removed process set still reduced")
    cases += 4

    hvd.barrier()
    print(f"collectives ok: rank {r} of {n}, {cases} cases", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
