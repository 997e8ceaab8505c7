"""``SyncBatchNorm``: batch normalization whose statistics cover the whole job's batch, not
each rank's part of it, as Horovod's ``hvd.SyncBatchNorm``."""

import torch

from hvd.torch import ops as _ops


def _channel_dims(x):
    return [0] + list(range(2, x.dim()))


def _per_channel(v, x):
    return v.view([1, -1] + [1] * (x.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        c = x.shape[1]
        dims = _channel_dims(x)
        xd = x.detach().double()
        stats = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                           torch.tensor([x.numel() // c], dtype=torch.float64)])
        _ops.allreduce_(stats, op=_ops.Sum)
        total = stats[-1].item()
        if total <= 1:
            raise ValueError(f"SyncBatchNorm needs more than one value per channel across the "
                             f"job, got {int(total)}")
        mean = stats[:c] / total
        var = (stats[c:2 * c] / total - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
                unbiased = var * total / (total - 1)
                running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        mean, invstd = mean.to(x.dtype), invstd.to(x.dtype)
        xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight, x) + _per_channel(bias, x)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total = total
        return y

    @staticmethod
    def backward(ctx, gy):
        xhat, weight, invstd = ctx.saved_tensors
        dims = _channel_dims(gy)
        c = gy.shape[1]
        sum_dy = gy.sum(dims)
        sum_dy_xhat = (gy * xhat).sum(dims)
        # Each rank's own parameter gradients: the optimizer reduces them like any other.
        grad_weight = sum_dy_xhat if weight is not None else None
        grad_bias = sum_dy if weight is not None else None
        stats = torch.cat([sum_dy, sum_dy_xhat]).double()
        _ops.allreduce_(stats, op=_ops.Sum)
        mean_dy = (stats[:c] / ctx.total).to(gy.dtype)
        mean_dy_xhat = (stats[c:] / ctx.total).to(gy.dtype)
        scale = invstd if weight is None else invstd * weight
        gx = (gy - _per_channel(mean_dy, gy) - xhat * _per_channel(mean_dy_xhat, gy))
        gx = gx * _per_channel(scale, gy)
        return gx, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization over the whole job's batch in training (over every rank's
    samples); in evaluation, the running statistics, as ``torch.nn.BatchNorm*d``."""

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        self._check_input_dim(x)
        if not self.training or _ops.size() == 1:
            return super().forward(x)
        if self.momentum is None:
            raise ValueError("SyncBatchNorm needs a momentum (a cumulative average is not "
                             "supported)")
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, running_mean,
                                            running_var, self.eps, self.momentum)
