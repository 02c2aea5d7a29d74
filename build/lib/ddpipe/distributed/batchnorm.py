"""BatchNorm variants that normalise over the global batch: the CPU SyncBatchNorm and the world-size-exact one,
sharing their math; ``convert_sync_batchnorm``.

torch.nn.SyncBatchNorm raises for CPU tensors, so on a gloo process group ``CPUSyncBatchNorm`` takes its place.
``ExactBatchNorm`` is the BatchNorm of the world-size-exact mode (``ddpipe.distributed.exact`` explains that mode): its
sums over the batch have the same bits at any world size. Both update the running statistics as torch does,
form the input gradient by one formula (``batchnorm_input_grad``) and apply per-channel scales and shifts with
one fused kernel (``affine``). Setting up the process group, and every sum over ranks, is
``ddpipe.distributed``'s job (shared memory when every rank is on this host and the mode is not exact).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddpipe.distributed.group import all_reduce_sum, world_size


def affine(t: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``t * scale + shift`` per channel in one fused pass: eval-mode batch_norm with mean 0, var 1
    and eps 0 is exactly that, and keeps bf16 activations bf16 (mixed bf16/fp32 addcmul was the
    slowest op of a step)."""
    zeros, ones = torch.zeros_like(scale), torch.ones_like(scale)
    return torch.batch_norm(t, scale, shift, zeros, ones, False, 0.0, 0.0, False)


def batchnorm_input_grad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                         invstd: torch.Tensor, mean_dy: torch.Tensor, mean_dy_xhat: torch.Tensor) -> torch.Tensor:
    """dx = w * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), the means over the global batch, as
    two fused per-channel affine maps of dy and x (``weight`` None: a BatchNorm without affine parameters,
    w = 1). The per-channel coefficients are computed in the dtype they come in (fp64 for the exact mode)
    and rounded to fp32 once."""
    a = invstd if weight is None else weight * invstd
    b = -a * invstd * mean_dy_xhat
    offset = -a * mean_dy - b * mean
    a, b, offset = a.float(), b.float(), offset.float()
    dx = affine(dy, a, offset)
    dx += affine(x, b, torch.zeros_like(b))
    return dx


def _check_global_count(total: torch.Tensor, x: torch.Tensor) -> None:
    """Training statistics need 2 values per channel in the global batch, as torch's BatchNorm over the
    concatenated batch demands (a rank alone may hold none, or one)."""
    if total <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {int(total)} over all "
                         f"ranks (input size {tuple(x.shape)} on this rank)")


# ---------------------------------------------------------------------------------------------
# CPU SyncBatchNorm


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalisation over the union of every rank's batch, with a hand-written backward.

    Forward all-reduces per-channel [sum, sum of squares, count]; backward all-reduces
    [sum(dy), sum(dy * x_hat)], as torch's CUDA SyncBatchNorm does; both in fp64 (a few values per
    channel). The passes over the activations use ATen's fused CPU batch-norm kernels (stats,
    eval-mode normalisation, backward reductions):
    composing var_mean and elementwise ops instead made a 2-process step 3x slower (BENCHMARKS.md).
    Weight and bias gradients stay local; DDP averages them like any other parameter's.
    ``weight`` and ``bias`` may be None (no affine parameters). A rank with no samples still joins both
    all-reduces, with zero sums (ATen's kernels reject empty inputs), as torch's SyncBatchNorm allows.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        c = x.shape[1]
        n_l = x.numel() / x.shape[1]
        if n_l:
            # Per-rank statistics from ATen's kernel (fp64 accumulation inside; fp32 even for bf16
            # activations), combined across ranks in fp64: E[x^2] - mean^2 in fp32 would lose up to
            # mean^2/var x 6e-8 of the variance to cancellation.
            mean_l, var_l = (t.double() for t in torch.batch_norm_update_stats(x.float(), None, None, 0.0))
            stats = torch.cat([mean_l * n_l, (var_l + mean_l * mean_l) * n_l, mean_l.new_full((1,), n_l)])
        else:
            stats = torch.zeros(2 * c + 1, dtype=torch.float64, device=x.device)
        all_reduce_sum(stats)
        total = stats[2 * c]
        _check_global_count(total, x)
        mean64 = stats[:c] / total
        var64 = (stats[c:2 * c] / total - mean64 * mean64).clamp_min(0.0)
        mean, var = mean64.float(), var64.float()
        y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
        invstd = torch.rsqrt(var64 + eps).float()
        ctx.save_for_backward(x, weight, mean, invstd)
        # A copy: an output kept on ctx itself (not through save_for_backward) makes a reference cycle, output ->
        # its grad_fn -> ctx -> output, that only Python's cyclic GC frees, with every saved activation of the
        # step: 2-process trainings grew by about 2 MB per step until a collection (1.2 GB in 3 epochs here)
        ctx.total, ctx.eps = total.clone(), eps
        return y, mean, var, total

    @staticmethod
    def backward(ctx, dy, _mean, _var, _total):
        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        if x.numel():
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, weight, None, None, mean, invstd, True, ctx.eps, [False, True, True])
        else:
            sum_dy_xhat = sum_dy = torch.zeros_like(mean)
        grad_weight, grad_bias = sum_dy_xhat.clone(), sum_dy.clone()  # local, as DDP expects
        both = torch.cat([sum_dy.double(), sum_dy_xhat.double()])
        all_reduce_sum(both)
        mean_dy, mean_dy_xhat = (both[:c] / ctx.total).float(), (both[c:] / ctx.total).float()
        if weight is None:
            dx = batchnorm_input_grad(dy, x, None, mean, invstd, mean_dy, mean_dy_xhat)
            return dx.to(x.dtype), None, None, None
        dx = batchnorm_input_grad(dy, x, weight.float(), mean, invstd, mean_dy, mean_dy_xhat)
        return dx.to(x.dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), None


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose batch statistics span all ranks, for CPU process groups (gloo).

    torch.nn.SyncBatchNorm raises for CPU tensors. This one gives the same outputs, input and
    parameter gradients (summed over ranks) and running statistics as one BatchNorm over the
    concatenated batch, for any input of 2 to 5 dimensions (what BatchNorm1d, 2d and 3d take), with or
    without affine parameters and running statistics, momentum a float or None (cumulative average),
    uneven and empty per-rank batches. Running statistics are updated as torch does (unbiased variance).
    Outside a multi-process group, or in eval mode, it is plain BatchNorm: like torch's SyncBatchNorm, an
    eval-mode layer without running statistics normalises by this rank's batch alone.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and world_size() > 1):
            return super().forward(x)
        self._check_input_dim(x)
        if x.shape[1] == 0:
            raise ValueError(f"expected input with at least one channel, got input size {tuple(x.shape)}")
        with torch.autocast(x.device.type, enabled=False):
            y, mean, var, total = _SyncBatchNormFunction.apply(x, self.weight, self.bias, self.eps)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(total.detach()))
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, total: float) -> None:
        self.num_batches_tracked += 1
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * (total / max(total - 1.0, 1.0))
        self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


# ---------------------------------------------------------------------------------------------
# World-size-exact BatchNorm


def _per_sample_sums(t: torch.Tensor) -> torch.Tensor:
    """fp32 sums over everything but the batch and channel dimensions, shape (N, C): each sample's
    sum is reduced in an order fixed by its own shape, so it has the same bits in any batch."""
    return t.sum(tuple(range(2, t.dim())), dtype=torch.float32) if t.dim() > 2 else t.float()


class _ExactBatchNormFunction(torch.autograd.Function):
    """Batch normalisation over the global batch from fp64 sums of per-sample partial sums."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, world):
        xf, c = x.float(), x.shape[1]
        parts = torch.stack([_per_sample_sums(xf), _per_sample_sums(xf * xf)]).double().sum(1).flatten()
        sums = all_reduce_sum(torch.cat([parts, parts.new_full((1,), x.numel() // c)]))
        count = sums[2 * c]
        mean = sums[:c] / count
        var = (sums[c:2 * c] / count - mean * mean).clamp_min(0.0)
        invstd = torch.rsqrt(var + eps)
        scale = weight.double() * invstd
        y = affine(x, scale.float(), (bias.double() - mean * scale).float())
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.world = world
        return y, mean.float(), var.float(), count

    @staticmethod
    def backward(ctx, dy, _mean, _var, _count):
        x, weight, mean, invstd, count = ctx.saved_tensors
        dyf, xf = dy.float(), x.float()
        parts = torch.stack([_per_sample_sums(dyf), _per_sample_sums(dyf * xf)]).double().sum(1).flatten()
        sum_dy, sum_dy_x = all_reduce_sum(parts).view(2, -1)
        sum_dy_xhat = (sum_dy_x - mean * sum_dy) * invstd
        dx = batchnorm_input_grad(dyf, xf, weight.double(), mean, invstd, sum_dy / count, sum_dy_xhat / count)
        return (dx.to(x.dtype), (sum_dy_xhat / ctx.world).to(weight.dtype), (sum_dy / ctx.world).to(weight.dtype),
                None, None)


class ExactBatchNorm(CPUSyncBatchNorm):
    """Training-mode BatchNorm over the global batch (synchronised across ranks, like SyncBatchNorm)
    with the same bits at any world size; running statistics updated as torch does. Eval: plain.
    Affine BatchNorm only (``ddpipe.distributed.exact.make_exact`` rejects the others)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return _BatchNorm.forward(self, x)
        with torch.autocast(x.device.type, enabled=False):
            y, mean, var, count = _ExactBatchNormFunction.apply(x, self.weight, self.bias, self.eps, world_size())
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(count.detach()))
        return y


# ---------------------------------------------------------------------------------------------
# Conversion


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Replace every BatchNorm in ``model`` (1d, 2d, 3d, torch's SyncBatchNorm) with a synchronised one:
    torch's on CUDA, ``CPUSyncBatchNorm`` on CPU, with the same parameters, running statistics, training
    flag and ``requires_grad``. Call it before wrapping the model in DDP."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _convert_cpu(model)


def _convert_cpu(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        like = module.weight if module.affine else module.running_mean
        factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
        out = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum,
                               module.affine, module.track_running_stats, **factory)
        if module.affine:
            with torch.no_grad():
                out.weight.copy_(module.weight)
                out.bias.copy_(module.bias)
            out.weight.requires_grad_(module.weight.requires_grad)
            out.bias.requires_grad_(module.bias.requires_grad)
        if module.track_running_stats:
            out.running_mean.copy_(module.running_mean)
            out.running_var.copy_(module.running_var)
            out.num_batches_tracked.copy_(module.num_batches_tracked)
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, _convert_cpu(child))
    return out
