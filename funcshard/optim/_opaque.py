"""torch's Adam and SGD kernels on a step's local tensors (:func:`run_adam`), and, in a compiled
step, as one operation of the graph.

[Note: the optimizer in a compiled step]
Traced into the graph (see [Note: funcshard under torch.compile] in ``_compile``), torch's Adam
kernel is a dozen operations per parameter tensor -- the moments, the bias corrections of its
own step count, the update -- and the in-place update of each parameter, moment and count one
more: most of a whole step's graph, and inductor's largest kernels, all compiled anew for every
model (BENCHMARKS.md, section 7). Under ``torch.compile`` the update is therefore one custom
operator per weight-decay group (``funcshard::adam_``, ``funcshard::sgd_``): it updates the
parameters, moments and counts in place (the graph's inputs, for the donated ``fs.optim.step``:
nothing is copied) by calling ``torch.optim``'s functional kernel at run time, as an eager step
does -- the way FSDP2 + ``torch.compile(model)`` keeps its optimizer step eager.

Inductor's decomposition of a mutating operator (``decompose_auto_functionalized``) grows
faster than linearly with the number of tensors it mutates, so the update is issued in chunks
of ``_CHUNK`` parameters (one kernel call each at run time).

With host counts the operators read the per-leaf step counts (CPU tensors) and a schedule's
learning rate on the host, which a CUDA graph would not replay: they are tagged
``cudagraph_unsafe``, so inductor's CUDA graphs (``mode="reduce-overhead"``) leave them out
instead of freezing the counts. With the counts on the device (``fused=True`` on a GPU,
``capturable=True``: see [Note: counts on the device] in ``_adam_sgd``) the update reads
nothing on the host -- the fused kernel reads its steps on the device, and the capturable one
is asked for as in an eager step -- so ``fs.cuda_graph`` can capture a compiled step.

The kernel is the one the optimizer was made with (``foreach``, ``fused``). Left to torch (both
``None``), a compiled step on CPU uses torch's fused kernel -- one pass over each tensor, as the
code inductor generated did -- where eager ``torch.optim`` loops over tensors one op at a time;
elsewhere torch's default. The learning rate of a schedule arrives as the graph's 0-dim tensor:
the fused kernels take it as it is, the others as a number (read once per step).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.optim.adam import adam as torch_adam
from torch.optim.sgd import sgd as torch_sgd

_ADAM = (
    "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] steps, float lr, Tensor? lr_tensor, float weight_decay, float beta1, "
    "float beta2, float eps, bool decoupled_weight_decay, bool maximize, bool? foreach, "
    "bool? fused, bool capturable) -> ()"
)
_SGD = (
    "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, float lr, "
    "Tensor? lr_tensor, float weight_decay, float momentum, float dampening, bool nesterov, "
    "bool maximize, bool? foreach, bool? fused) -> ()"
)


_CHUNK = 8  # parameters per operator: see [Note: the optimizer in a compiled step]


def _chunks(n: int) -> list[slice]:
    return [slice(i, i + _CHUNK) for i in range(0, n, _CHUNK)]


def dense(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads``, the non-contiguous ones copied.

    [Note: fused kernels read dense gradients]
    torch's fused Adam and SGD kernels on CPU read a non-contiguous gradient as if it were
    contiguous, updating with the wrong elements (torch 2.13; the loops over tensors are right):
    the gradient of a shard of a dim other than 0, cut out of its padded chunk when the size
    does not divide, is such a view. ``tests/test_compile.py`` trains one.
    """
    return [g if g.is_contiguous() else g.contiguous() for g in grads]


def run_adam(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float | torch.Tensor,
    weight_decay: float, foreach: bool | None, fused: bool | None, capturable: bool = False,
    **options: Any,
) -> None:  # fmt: skip
    """torch's Adam kernel on these local tensors, in place; ``options``: its other keyword
    arguments (``beta1``, ``beta2``, ``eps``, ``decoupled_weight_decay``, ``amsgrad``,
    ``maximize``).

    [Note: the fused kernel called directly]
    ``torch.optim.adam.adam(fused=True)`` sorts its lists by device and dtype in C++
    (``_group_tensors_by_device_and_dtype``, a visit of every tensor of the five lists: after
    the kernel and the steps' increment, the largest piece of a host-bound AdamW step; see
    BENCHMARKS.md), increments the steps and calls ``torch._fused_adam(w)_`` once per group.
    When every parameter has one device and one dtype -- the moments and gradients have their
    parameter's (``fs.optim``'s update checks it); the steps are the state's own -- there is
    one group, and those two calls are made here: the same kernel on the same lists with the
    same arguments, so the same bits (``tests/test_optim.py`` compares with
    ``torch.optim.AdamW(fused=True)`` over many steps). Anything else (several dtypes, an lr
    tensor on another device) goes through torch's function.
    """
    if fused:
        grads = dense(grads)  # see [Note: fused kernels read dense gradients]
        if _one_group(params, lr):
            kernel = (
                torch._fused_adamw_ if options["decoupled_weight_decay"] else torch._fused_adam_
            )
            torch._foreach_add_(steps, 1)
            kernel(
                params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=options["amsgrad"],
                lr=lr, beta1=options["beta1"], beta2=options["beta2"], weight_decay=weight_decay,
                eps=options["eps"], maximize=options["maximize"], grad_scale=None, found_inf=None,
            )  # fmt: skip
            return
    torch_adam(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=foreach, fused=fused, lr=lr,
        weight_decay=weight_decay, capturable=capturable, **options,
    )  # fmt: skip


def _one_group(params: list[torch.Tensor], lr: float | torch.Tensor) -> bool:
    """Whether torch's fused kernel takes ``params`` as one list (see [Note: the fused kernel
    called directly])."""
    if not params:
        return False
    devices = set(map(_DEVICE, params))
    if len(devices) != 1 or len(set(map(_DTYPE, params))) != 1:
        return False
    return not isinstance(lr, torch.Tensor) or lr.device in devices


_DTYPE, _DEVICE = operator.attrgetter("dtype"), operator.attrgetter("device")


def _lr(lr: float, lr_tensor: torch.Tensor | None, as_tensor: bool | None):
    """The learning rate for the kernel: the tensor itself where it reads one (fused,
    capturable), else a number."""
    if lr_tensor is None:
        return lr
    return lr_tensor if as_tensor else float(lr_tensor)


@torch.library.custom_op(
    "funcshard::adam_",
    mutates_args=("params", "exp_avgs", "exp_avg_sqs", "steps"),
    schema=_ADAM,
    tags=(torch.Tag.cudagraph_unsafe,),  # see [Note: the optimizer in a compiled step]
)
def _adam(
    params, grads, exp_avgs, exp_avg_sqs, steps, lr, lr_tensor, weight_decay, beta1, beta2, eps,
    decoupled_weight_decay, maximize, foreach, fused, capturable,
) -> None:  # fmt: skip
    run_adam(
        params, grads, exp_avgs, exp_avg_sqs, steps, foreach=foreach, fused=fused,
        lr=_lr(lr, lr_tensor, fused or capturable), weight_decay=weight_decay, beta1=beta1,
        beta2=beta2, eps=eps, decoupled_weight_decay=decoupled_weight_decay, amsgrad=False,
        maximize=maximize, capturable=capturable,
    )  # fmt: skip


@_adam.register_fake
def _(*args) -> None:
    return None


@torch.library.custom_op(
    "funcshard::sgd_",
    mutates_args=("params", "momentum_buffers"),
    schema=_SGD,
    tags=(torch.Tag.cudagraph_unsafe,),  # see [Note: the optimizer in a compiled step]
)
def _sgd(
    params, grads, momentum_buffers, lr, lr_tensor, weight_decay, momentum, dampening, nesterov,
    maximize, foreach, fused,
) -> None:  # fmt: skip
    if nesterov:  # torch's foreach Nesterov adds into the gradients, which are not ours
        grads = [g.clone() for g in grads]
    elif fused:  # see [Note: fused kernels read dense gradients]
        grads = dense(grads)
    torch_sgd(
        params, grads, list(momentum_buffers) or [None] * len(params),
        foreach=foreach, fused=fused, lr=_lr(lr, lr_tensor, False), weight_decay=weight_decay,
        momentum=momentum, dampening=dampening, nesterov=nesterov, maximize=maximize,
    )  # fmt: skip


@_sgd.register_fake
def _(*args) -> None:
    return None


def _kernel(params: list[torch.Tensor], foreach: bool | None, fused: bool | None):
    """(foreach, fused) for a compiled step: see [Note: the optimizer in a compiled step]."""
    if foreach is None and fused is None:
        cpu = all(p.device.type == "cpu" and p.is_floating_point() for p in params)
        return None, (True if cpu and params else None)
    return foreach, fused


def _split_lr(lr: float | torch.Tensor) -> tuple[float, torch.Tensor | None]:
    return (0.0, lr) if isinstance(lr, torch.Tensor) else (float(lr), None)


def adam(
    params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, weight_decay, foreach, options,
    capturable=False,
):  # fmt: skip
    """torch's Adam kernel on these lists, as one operation of the compiled graph; ``options``:
    the kernel's other keyword arguments (``fs.optim.adam``'s); ``capturable``: torch's
    capturable kernel (the steps on the parameters' device, read there)."""
    opts: dict[str, Any] = dict(options)
    foreach, fused = _kernel(params, foreach, opts["fused"])
    for c in _chunks(len(params)):
        torch.ops.funcshard.adam_(
            params[c], grads[c], exp_avgs[c], exp_avg_sqs[c], steps[c], *_split_lr(lr),
            weight_decay, opts["beta1"], opts["beta2"], opts["eps"],
            opts["decoupled_weight_decay"], opts["maximize"], foreach, fused, capturable,
        )  # fmt: skip


def sgd(params, grads, momentum_buffers, *, lr, weight_decay, foreach, options):
    """torch's SGD kernel on these lists, as one operation of the compiled graph;
    ``momentum_buffers``: empty without momentum."""
    foreach, fused = _kernel(params, foreach, None)
    for c in _chunks(len(params)):
        torch.ops.funcshard.sgd_(
            params[c], grads[c], momentum_buffers[c], *_split_lr(lr), weight_decay,
            options["momentum"], options["dampening"], options["nesterov"], options["maximize"],
            foreach, fused,
        )  # fmt: skip
