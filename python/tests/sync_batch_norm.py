"""``hvd.SyncBatchNorm`` under ``horovodrun -np N``: each rank's output, input gradient and
running statistics equal those of ``torch.nn.BatchNorm`` over the union of every rank's batch
(computed here), and the ranks' parameter gradients sum to the union's.

Prints ``sync_batch_norm ok: rank R of N`` and exits 0, or raises.
"""

import torch

import hvd.torch as hvd


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for shape, bn in [((3, 4, 5, 5), torch.nn.BatchNorm2d), ((4, 6), torch.nn.BatchNorm1d),
                      ((2, 3, 7), torch.nn.BatchNorm1d)]:
        torch.manual_seed(1)
        parts = [torch.randn(*shape, dtype=torch.float64) * (p + 1) + p for p in range(n)]
        weights = [torch.randn(*shape, dtype=torch.float64) for _ in range(n)]
        c = shape[1]

        # The union, in one process.
        ref = bn(c).double()
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
        union = torch.cat(parts).requires_grad_(True)
        out = ref(union)
        (out * torch.cat(weights)).sum().backward()

        sync = hvd.SyncBatchNorm(c).double()
        with torch.no_grad():
            sync.weight.copy_(ref.weight)
            sync.bias.copy_(ref.bias)
        mine = parts[r].clone().requires_grad_(True)
        y = sync(mine)
        (y * weights[r]).sum().backward()

        rows = slice(r * shape[0], (r + 1) * shape[0])
        assert torch.allclose(y, out[rows], atol=1e-9), (shape, (y - out[rows]).abs().max())
        assert torch.allclose(mine.grad, union.grad[rows], atol=1e-9), shape
        assert torch.allclose(sync.running_mean, ref.running_mean, atol=1e-9), shape
        assert torch.allclose(sync.running_var, ref.running_var, atol=1e-9), shape
        gw = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
        gb = hvd.allreduce(sync.bias.grad, op=hvd.Sum)
        assert torch.allclose(gw, ref.weight.grad, atol=1e-9), shape
        assert torch.allclose(gb, ref.bias.grad, atol=1e-9), shape
        # Evaluation uses the running statistics, as BatchNorm does.
        sync.eval()
        ref.eval()
        assert torch.allclose(sync(parts[r]), ref(parts[r]), atol=1e-9)
    print(f"sync_batch_norm ok: rank {r} of {n}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
