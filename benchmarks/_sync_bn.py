"""A CPU SyncBatchNorm for the DDP contender of benchmarks/real_models.py.

torch's ``nn.SyncBatchNorm`` runs only on GPUs (its statistics kernels are CUDA ones), so on
this machine the data-parallel CNN comparison needs a hand-written one with the same
semantics: the batch statistics of every BatchNorm layer are those of the global batch (one
all-reduce of the per-channel sums, sums of squares and count in forward, one of the two
gradient sums in backward); the weight and bias gradients stay local (DDP reduces them with
the other gradients), as in torch's. ``sync_batch_norm(module, group)`` swaps it in for every
BatchNorm2d of a module.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, c] + [1] * (x.dim() - 2)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), x.new_full((1,), x.numel() // c)])
        dist.all_reduce(stats, group=group)
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        invstd = torch.rsqrt(var + eps)
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            running_var.mul_(1 - momentum).add_(var * (n / (n - 1)), alpha=momentum)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd, n)
        ctx.group = group
        return xhat * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd, n = ctx.saved_tensors
        c = dy.shape[1]
        dims = [0] + list(range(2, dy.dim()))
        shape = [1, c] + [1] * (dy.dim() - 2)
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)
        both = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(both, group=ctx.group)
        dx = (dy - both[:c].view(shape) / n - xhat * (both[c:].view(shape) / n)) \
            * (weight * invstd).view(shape)
        return dx, sum_dy_xhat, sum_dy, None, None, None, None, None


class SyncBatchNorm2d(torch.nn.BatchNorm2d):
    group = None

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        self.num_batches_tracked.add_(1)
        return _SyncBatchNorm.apply(x, self.weight, self.bias, self.running_mean,
                                    self.running_var, self.eps, self.momentum, self.group)


def sync_batch_norm(module: torch.nn.Module, group=None) -> torch.nn.Module:
    """``module`` with every BatchNorm2d replaced by a SyncBatchNorm2d (same state)."""
    for name, child in module.named_children():
        if type(child) is torch.nn.BatchNorm2d:
            sync = SyncBatchNorm2d(child.num_features, child.eps, child.momentum)
            sync.load_state_dict(child.state_dict())
            sync.group = group
            setattr(module, name, sync)
        else:
            sync_batch_norm(child, group)
    return module
