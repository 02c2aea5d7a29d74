"""World-size-exact training (``distributed.exact: true``, CPU only): arithmetic whose result does not
depend on how a global batch is split over processes and threads, so that 1 and N processes with the
same global batch train to the same weights, not merely to weights within float noise of each other.

Why it is needed: with ordinary arithmetic the rounding of every sum over the batch depends on the
split, and training amplifies those last-bit differences (ReLU and max-pool decisions flip, AdamW
normalises the changed gradients): 2 epochs end ~19% apart, as far as one process run with 1 thread
instead of 2 (docs/training.md, "Determinism and world-size invariance").

How: the per-sample operations of a step (convolution and linear outputs and input gradients,
pooling, activations, the loss's per-sample gradients) give each sample the same bits whatever batch
it sits in and however many threads run (``tests/test_exact.py`` checks this on the machine at hand).
What differs are the sums over the batch: BatchNorm's statistics and backward sums, and the weight and
bias gradients. Here each is accumulated in fp64 over the local batch, all-reduced in fp64 and rounded
once, so it has the same bits at any world size (fp64's own order-dependence, ~1e-16 relative, is far
below fp32's last bit). Gradients come out as global sum / world size on every rank, which DDP's
average turns back into the global sum: exactly when the world size is a power of two.

Limits: CPU (cuDNN chooses its algorithms by batch size); no ``torch.compile`` (fusion may reorder the
per-sample arithmetic); layers: Conv2d (groups 1, zero padding), Linear, affine BatchNorm (its exact
version, ``ExactBatchNorm``, lives in ``ddpipe.distributed.batchnorm`` beside the CPU SyncBatchNorm whose math it
shares). The loss is a mean over the local batch, so per-sample gradients are scaled by 1 / local
batch: exact when the world sizes compared differ by powers of two. Cost: mostly the fp64 weight
gradients, 2.6x (fp32) to 4.2x (bf16) a normal step (BENCHMARKS.md, "World-size-exact mode").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddpipe.distributed.batchnorm import ExactBatchNorm
from ddpipe.distributed.group import all_reduce_sum, world_size


def _param_grads(grad_w: torch.Tensor, grad_b: torch.Tensor | None, world: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Local fp64 weight (and bias) gradients -> global sum / world size, rounded once to ``dtype``;
    one all-reduce for both."""
    flat = torch.cat([grad_w.flatten()] + ([grad_b] if grad_b is not None else []))
    flat = all_reduce_sum(flat) / world
    n = grad_w.numel()
    return flat[:n].view(grad_w.shape).to(dtype), (flat[n:].to(dtype) if grad_b is not None else None)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """What autocast would run the layer in (bf16 under bf16 autocast), else the weight's dtype."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


class _Conv2dFn(torch.autograd.Function):
    """Convolution whose weight and bias gradients are fp64 sums over the global batch."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, dtype, world):
        xc, wc = x.to(dtype), weight.to(dtype)
        y = F.conv2d(xc, wc, None if bias is None else bias.to(dtype), stride, padding, dilation)
        ctx.save_for_backward(xc, wc)
        ctx.conf = (stride, padding, dilation, world, bias is not None, x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        stride, padding, dilation, world, has_bias, x_dtype, w_dtype = ctx.conf
        dy = dy.to(xc.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.convolution_backward(
                dy, xc, wc, None, stride, padding, dilation, False, [0, 0], 1, [True, False, False])[0].to(x_dtype)
        # grad_w[:, :, i, j] = sum over (n, h, w) of dy (x) the input window at kernel offset (i, j): one fp64
        # GEMM per offset over channels-last views, no im2col buffer
        c_out, c_in, kh, kw = wc.shape
        (ph, pw), (sh, sw), (dh, dw), (ho, wo) = padding, stride, dilation, dy.shape[2:]
        xp = F.pad(xc, (pw, pw, ph, ph)).permute(0, 2, 3, 1)  # N, H + 2ph, W + 2pw, C_in
        dyt = dy.permute(0, 2, 3, 1).reshape(-1, c_out).double()  # (N*Ho*Wo, C_out)
        grad_w64 = torch.empty(c_out, c_in, kh, kw, dtype=torch.float64)
        for i in range(kh):
            for j in range(kw):
                window = xp[:, i * dh: i * dh + sh * (ho - 1) + 1: sh, j * dw: j * dw + sw * (wo - 1) + 1: sw]
                grad_w64[:, :, i, j] = dyt.t() @ window.reshape(-1, c_in).double()
        grad_w, grad_b = _param_grads(grad_w64, dyt.sum(0) if has_bias else None, world, w_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class _ExactLayer(nn.Module):
    """Training with gradients: the layer's exact autograd function, run in the dtype autocast would
    pick (autocast itself off inside); otherwise the plain layer's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return super().forward(x)
        dtype = _compute_dtype(x, self.weight)
        with torch.autocast(x.device.type, enabled=False):
            return self._exact(x, dtype, world_size())


class ExactConv2d(_ExactLayer, nn.Conv2d):
    """nn.Conv2d (groups 1, zero padding) whose gradients are world-size exact when training."""

    def _exact(self, x: torch.Tensor, dtype: torch.dtype, world: int) -> torch.Tensor:
        return _Conv2dFn.apply(x, self.weight, self.bias, self.stride, self.padding, self.dilation, dtype, world)


class _LinearFn(torch.autograd.Function):
    """Linear layer whose weight and bias gradients are fp64 sums over the global batch."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, world):
        xc, wc = x.to(dtype), weight.to(dtype)
        y = F.linear(xc, wc, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(xc, wc)
        ctx.conf = (world, bias is not None, x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        world, has_bias, x_dtype, w_dtype = ctx.conf
        dy = dy.to(xc.dtype)
        grad_x = (dy @ wc).to(x_dtype) if ctx.needs_input_grad[0] else None
        dyd, xd = dy.double().reshape(-1, wc.shape[0]), xc.double().reshape(-1, wc.shape[1])
        grad_w, grad_b = _param_grads(dyd.t() @ xd, dyd.sum(0) if has_bias else None, world, w_dtype)
        return grad_x, grad_w, grad_b, None, None


class ExactLinear(_ExactLayer, nn.Linear):
    """nn.Linear whose gradients are world-size exact when training."""

    def _exact(self, x: torch.Tensor, dtype: torch.dtype, world: int) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self.bias, dtype, world)


def check_exact(model: nn.Module) -> None:
    """ValueError naming the first layer of ``model`` that this mode cannot make exact; the model is untouched."""
    for name, module in model.named_modules():
        if type(module) is nn.Conv2d:
            if module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
                raise ValueError(f"distributed.exact: layer {name!r} is a Conv2d with groups={module.groups}, "
                                 f"padding={module.padding!r}, padding_mode={module.padding_mode!r}; accepted: "
                                 "groups 1 and numeric zero padding")
        elif isinstance(module, _BatchNorm):
            if not module.affine:
                raise ValueError(f"distributed.exact: layer {name!r} is a BatchNorm without affine parameters; "
                                 "accepted: affine BatchNorm")
        elif type(module) is not nn.Linear and not isinstance(module, (ExactConv2d, ExactLinear)) and \
                any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"distributed.exact: layer {name!r} ({type(module).__name__}) has parameters but no "
                             "world-size-exact implementation; accepted: Conv2d, Linear and BatchNorm layers")


def make_exact(model: nn.Module) -> nn.Module:
    """The model with its Conv2d, Linear and BatchNorm layers made world-size exact (in place: same
    parameters and buffers, so the state dict and a rebuilt plain model load each other). Raises
    ValueError naming the first layer this mode cannot make exact (:func:`check_exact`), before changing any."""
    check_exact(model)
    for module in model.modules():
        if type(module) is nn.Conv2d:
            module.__class__ = ExactConv2d
        elif type(module) is nn.Linear:
            module.__class__ = ExactLinear
        elif isinstance(module, _BatchNorm):
            module.__class__ = ExactBatchNorm
    return model


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Gradient clipping whose norm is an fp64 sum, so the same gradients give the same factor at
    any thread count (torch's clip_grad_norm_ sums in fp32, in an order that depends on threads)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    factor = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(factor.to(g.dtype))
    return total
