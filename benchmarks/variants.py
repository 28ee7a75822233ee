"""The frameworks compared: one small function each, ``variant(workload, mesh, options) ->
Trainer``, registered in ``VARIANTS``.

A ``Trainer`` is one framework's training step on one model, split into the phases the
memory accounting needs. Both frameworks get the same model, the same grouping (FSDP2:
``fully_shard`` on every module of ``workload.group_types``, then the root; funcshard: a plan
with ``fs.policy.by_type`` of the same types) and the same optimizer arithmetic (AdamW:
``torch.optim.AdamW`` vs the donated ``fs.optim.step`` of ``fs.optim.adamw``, both with torch's
default kernel choice, or the fused kernels with ``Options.fused``). ``plain`` is the same
model unsharded (bf16 through ``torch.autocast``): the floor. Adding a variant is one function
here and one line in ``VARIANTS``.

The compiled variants (part ``compile``) compile with ``Options.compile_backend``
(inductor, the default) through a ``CompileCounterWithBackend`` kept in ``Trainer.counter``
(graphs and recompilations): FSDP2 +
``torch.compile(model)``, or each group module compiled before ``fully_shard`` (torchtitan's
order; ``fsdp2 + compile per block``), the optimizer step eager; funcshard's whole training step
(``fs.value_and_grad`` + ``fs.optim.step``, constant learning rate) under
``torch.compile(fullgraph=True)``, over ``fs.schedule``'s ``apply`` or over ``fs.unshard`` of
the whole tree (docs/compile.md, "The recommended pattern"), or under ``fs.jit`` (traced once by
funcshard, compiled by inductor; ``aot_eager``: the traced graph run as it is).
``cuda_graph(variant)`` runs a variant's whole step as one captured CUDA graph (``Graphed``;
part ``gpu``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import funcshard as fs

from .workloads import Workload


@dataclasses.dataclass(frozen=True)
class Options:
    """What a comparison varies. ``param_dtype``: the dtype gathered and computed in (``None``:
    the parameters' own); gradients are then reduced in fp32. ``prefetch`` /
    ``backward_prefetch`` / ``merge_bytes`` are funcshard's plan (FSDP2 keeps its defaults);
    ``module_groups`` gives FSDP2 explicit groups (each a list of module fqns sharded together,
    ``fully_shard([...])``) instead of one per module of ``group_types``. ``recompute``:
    activation checkpointing of every group module (``True``) or of those named (a tuple of
    module names, e.g. ``("blocks.0", "blocks.1")``) -- FSDP2: ``checkpoint_wrapper``
    (non-reentrant) around each, then ``fully_shard`` on the wrappers (torchtitan's order);
    funcshard: ``fs.plan(..., recompute=True | [names])``; or ``OPS``, FSDP2 only:
    [Note: torchtitan's selective activation checkpointing]. ``fused``: AdamW's fused kernel
    (``fused=`` of ``torch.optim.AdamW`` and ``fs.optim.adamw``; ``None``: torch's default);
    ``capturable``: ``torch.optim.AdamW(capturable=True)``, its step counts on the device (a
    step inside a CUDA graph)."""

    param_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    prefetch: int = 1
    backward_prefetch: int = 1
    merge_bytes: int | None = None
    module_groups: tuple[tuple[str, ...], ...] | None = None  # FSDP2: fully_shard these lists
    lr: float = 1e-3
    weight_decay: float = 0.1
    compile_backend: str = "inductor"  # the compiled variants' (``--quick``: aot_eager)
    recompute: bool | tuple[str, ...] | str = False  # str: OPS (FSDP2 only)
    fused: bool | None = None
    capturable: bool = False

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.param_dtype is not None else None


@dataclasses.dataclass
class Trainer:
    """One framework's training step. ``forward_backward(batch)`` leaves the gradients in place
    (returns the loss); ``optimizer_step()`` applies them and drops them. ``parameters``,
    ``gradients`` and ``optimizer_state`` list the local tensors (for memory accounting)."""

    forward_backward: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]
    optimizer_step: Callable[[], None]
    parameters: Callable[[], list[torch.Tensor]]
    gradients: Callable[[], list[torch.Tensor]]
    optimizer_state: Callable[[], list[torch.Tensor]]
    plan: fs.Plan | None = None
    counter: Any = None  # compiled variants: their CompileCounterWithBackend

    def step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = self.forward_backward(batch)
        self.optimizer_step()
        return loss


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def fsdp2(
    w: Workload, mesh: DeviceMesh, o: Options, *, compiled: bool = False, per_block: bool = False
) -> Trainer:
    """``fully_shard`` on every group module and the root; ``torch.optim.AdamW``. ``compiled``:
    the forward runs ``torch.compile(model)`` (``o.compile_backend``), the optimizer eager;
    ``per_block``: each group module is compiled instead, before ``fully_shard`` (torchtitan).
    A model built on meta (``w.shards``) is sharded there, then given storage
    (``to_empty``) and ``w.shards``' values, as torchtitan initialises it."""
    model = w.build()
    initial = _initial(w, model, mesh) if w.shards is not None else None
    mp = MixedPrecisionPolicy(param_dtype=o.param_dtype, reduce_dtype=o.reduce_dtype)
    kw = dict(mesh=mesh, reshard_after_forward=o.reshard_after_forward, mp_policy=mp)
    counter = CompileCounterWithBackend(o.compile_backend) if compiled or per_block else None
    if o.module_groups is not None:
        for names in o.module_groups:
            fully_shard([model.get_submodule(n) for n in names], **kw)
    else:
        groups = _group_modules(model, w.group_types, o.recompute)
        for m in _compile_each(model, groups, counter) if per_block else groups:
            fully_shard(m, **kw)
    # the root: FSDP2's default (None) keeps it unsharded from forward to backward, as funcshard
    root = None if o.reshard_after_forward else False
    fully_shard(model, **{**kw, "reshard_after_forward": root})
    if initial is not None:
        _fill(model, *initial, device=mesh.device_type)
    net = torch.compile(model, backend=counter) if compiled else model
    return _torch_trainer(w, model, net, _adamw(model, o), counter)


def plain(w: Workload, mesh: DeviceMesh, o: Options, *, compiled: bool = False) -> Trainer:
    """The model unsharded (``mesh`` unused), ``torch.optim.AdamW``: the floor. With
    ``o.param_dtype``, the forward runs under ``torch.autocast`` to it (fp32 parameters and
    gradients, the matmuls in ``param_dtype``; the autocast cache off, as CUDA graphs need).
    ``compiled``: ``torch.compile(model)`` (``o.compile_backend``), one graph of every block
    (no hooks to break it), the optimizer eager."""
    counter = CompileCounterWithBackend(o.compile_backend) if compiled else None
    model = w.build()
    compiled_model = torch.compile(model, backend=counter) if compiled else model
    device = next(model.parameters()).device.type
    autocast = lambda: torch.autocast(
        device, o.param_dtype or torch.float32, enabled=o.param_dtype is not None,
        cache_enabled=False,
    )  # fmt: skip

    def net(*batch):
        with autocast():
            return compiled_model(*batch)

    return _torch_trainer(w, model, net, _adamw(model, o), counter)


def _adamw(model: torch.nn.Module, o: Options) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(), lr=o.lr, weight_decay=o.weight_decay, fused=o.fused,
        capturable=o.capturable,
    )  # fmt: skip


def _torch_trainer(w: Workload, model, net, opt, counter) -> Trainer:
    """The step of a torch.optim user: ``net(*batch)``, the loss, backward, ``opt.step()``."""

    def forward_backward(batch):
        loss = w.loss(net(*batch), batch)
        loss.backward()
        return loss.detach()

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Trainer(
        forward_backward,
        optimizer_step,
        parameters=lambda: [_local(p) for p in model.parameters()],
        gradients=lambda: [_local(p.grad) for p in model.parameters() if p.grad is not None],
        optimizer_state=lambda: [
            _local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
        ],
        counter=counter,
    )


def _compile_each(model, modules, backend) -> list[torch.nn.Module]:
    """Each of ``modules`` replaced in its parent by ``torch.compile(module)``; the wrappers."""
    parents = {id(m): (model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
               for n, m in model.named_modules() if n}  # fmt: skip
    out = []
    for m in modules:
        parent, name = parents[id(m)]
        out.append(torch.compile(m, backend=backend))
        parent.register_module(name, out[-1])
    return out


def _group_modules(model, types, recompute: bool | tuple[str, ...] | str) -> list[torch.nn.Module]:
    """FSDP2's group modules, children before parents; with ``recompute`` (``True``: all; a tuple:
    those named; ``"ops"``: all, torchtitan's selection of operators), each wrapped in a
    non-reentrant ``checkpoint_wrapper`` first (the wrappers are returned in their place)."""
    groups = [m for m in model.modules() if isinstance(m, types) and m is not model]
    if recompute:
        names = {m: n for n, m in model.named_modules()}
        every = recompute is True or recompute == OPS
        chosen = {id(m) for m in groups if every or names[m] in recompute}
        options = dict(context_fn=_every_other_matmul) if recompute == OPS else {}
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options
            ),
            check_fn=lambda m: id(m) in chosen,
        )
        types = (*types, CheckpointWrapper)
        wrapped = {id(m._checkpoint_wrapped_module) for m in model.modules()
                   if isinstance(m, CheckpointWrapper)}  # fmt: skip
        groups = [m for m in model.modules()
                  if isinstance(m, types) and m is not model and id(m) not in wrapped]  # fmt: skip
    return list(reversed(groups))


# [Note: torchtitan's selective activation checkpointing]
# torchtitan trains Llama 3 8B with "selective" activation checkpointing of every block, option
# "op": inside each block's checkpoint, the outputs of attention and of every other matmul (the
# 1st, 3rd, ... in the order the block runs them) are saved, and everything else -- the other
# matmuls, norms, rotary embeddings, activations -- is recomputed in backward. funcshard's plan
# recomputes whole groups (``recompute=True``, every k-th, or named groups), not operators.
OPS = "ops"
_aten = torch.ops.aten
_SAVED = {  # besides every other matmul (the names SDPA dispatches to, by backend)
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten.max.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _every_other_matmul():
    """A checkpoint's ``context_fn``: [Note: torchtitan's selective activation checkpointing]."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls = {False: 0, True: 0}  # counted apart in the forward and in its recompute

    def policy(ctx, func, *args, **kwargs):
        if func is _aten.mm.default:
            matmuls[ctx.is_recompute] += 1
            keep = matmuls[ctx.is_recompute] % 2 == 1
        else:
            keep = func in _SAVED
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _initial(w: Workload, model: torch.nn.Module, mesh: DeviceMesh) -> tuple[dict, dict]:
    """The model's initial parameters as shards over ``mesh``, and its buffers: ``w.shards``
    for a model built on meta, else ``fs.shard`` of its own tensors."""
    if w.shards is not None:
        return w.shards(model, mesh)
    params, buffers = fs.extract(model)
    return fs.shard(params, mesh), buffers


def _fill(model: torch.nn.Module, sharded: dict, buffers: dict, device: str) -> None:
    """A model sharded by ``fully_shard`` on meta: storage on ``device``, then the values of
    ``sharded`` (each rank's shard into FSDP2's) and ``buffers``, by name (wrappers' prefixes,
    ``_checkpoint_wrapped_module`` and ``_orig_mod``, left out)."""
    model.to_empty(device=device)
    plain = lambda name: re.sub(r"(_checkpoint_wrapped_module|_orig_mod)\.", "", name)
    with torch.no_grad():
        for name, p in model.named_parameters():
            _local(p).copy_(_local(sharded[plain(name)]))
        for name, b in model.named_buffers():
            b.copy_(buffers[plain(name)])


def fsdp2_compiled(w: Workload, mesh: DeviceMesh, o: Options) -> Trainer:
    return fsdp2(w, mesh, o, compiled=True)


def fsdp2_compiled_blocks(w: Workload, mesh: DeviceMesh, o: Options) -> Trainer:
    return fsdp2(w, mesh, o, per_block=True)


def funcshard(
    w: Workload,
    mesh: DeviceMesh,
    o: Options,
    *,
    compiled: bool = False,
    unshard: bool = False,
    graphed: bool = False,
    jitted: bool = False,
) -> Trainer:
    """``fs.schedule`` with the same grouping; ``fs.optim.step`` of ``fs.optim.adamw``.
    ``unshard``: the loss runs the model on ``fs.unshard`` of the whole tree instead (no plan);
    ``compiled``: the whole step is ``torch.compile(train_step, fullgraph=True)`` (inductor),
    ``forward_backward`` runs all of it and ``optimizer_step`` nothing; ``graphed``: the same
    whole step through ``fs.cuda_graph`` (AdamW with its counts on the device); both: the
    compiled step through ``fs.cuda_graph``; ``jitted``: the whole step is ``fs.jit(train_step)``
    (inductor; with the ``aot_eager`` backend, the traced graph as it is), with ``graphed``
    through ``fs.cuda_graph`` too."""
    model = w.build()
    sharded, buffers = _initial(w, model, mesh)
    plan = None if unshard else plan_for(w, model, o)
    model.to("meta")
    opt = fs.optim.adamw(
        o.lr, weight_decay=o.weight_decay, fused=o.fused, capturable=graphed and not o.fused
    )
    box: dict[str, Any] = {"params": sharded, "state": opt.init(sharded), "grads": None}
    # the buffers are an argument, not the loss's closure: under torch.compile a closure's
    # tensors are constants of the graph, which inductor refuses where a scheduled block takes
    # them as an argument (a Llama's rotary tables)
    if unshard:

        def loss_fn(p, batch, buffers):
            full = fs.unshard(p, param_dtype=o.param_dtype, reduce_dtype=o.reduce_dtype)
            return w.loss(fs.functional_call(model, (full, buffers), batch), batch)

    else:
        apply = fs.schedule(model, plan, param_dtype=o.param_dtype, reduce_dtype=o.reduce_dtype)

        def loss_fn(p, batch, buffers):
            return w.loss(apply(p, *batch, buffers=buffers), batch)

    leaves = lambda tree: [_local(t) for t in torch.utils._pytree.tree_leaves(tree)]
    trees = dict(
        parameters=lambda: leaves(box["params"]),
        gradients=lambda: [g for g in leaves(box["grads"]) if g is not None],
        optimizer_state=lambda: [t for t in leaves(box["state"]) if torch.is_tensor(t)],
    )
    if compiled or graphed or jitted:
        vg = fs.value_and_grad(loss_fn)  # made once, outside the compiled function

        def train_step(params, state, batch, buffers):
            loss, grads = vg(params, batch, buffers)
            params, state = fs.optim.step(opt, params, grads, state)
            return loss, params, state

        counter = CompileCounterWithBackend(o.compile_backend) if compiled else None
        step = (
            torch.compile(train_step, backend=counter, fullgraph=True) if compiled else train_step
        )
        if jitted:
            backend = "eager" if o.compile_backend == "aot_eager" else o.compile_backend
            step = counter = Traces(fs.jit(train_step, backend=backend))
        if graphed:
            step = PoolCounted(fs.cuda_graph(step))

        def whole_step(batch):
            loss, box["params"], box["state"] = step(box["params"], box["state"], batch, buffers)
            return loss.detach()

        whole_step.pool_extra = lambda: getattr(step, "pool_extra", 0)  # type: ignore[attr-defined]
        whole_step.pool_measure = lambda: getattr(step, "pool_measure", "")  # type: ignore[attr-defined]
        return Trainer(whole_step, lambda: None, **trees, plan=plan, counter=counter)

    def forward_backward(batch):
        loss, box["grads"] = fs.value_and_grad(loss_fn)(box["params"], batch, buffers)
        return loss

    def optimizer_step():
        box["params"], box["state"] = fs.optim.step(opt, box["params"], box["grads"], box["state"])
        box["grads"] = None

    return Trainer(forward_backward, optimizer_step, **trees, plan=plan)


def pool_free_bytes(pool: tuple[int, int], allocated: int, reserved: int) -> tuple[int, str]:
    """What a CUDA graph's private memory pool ``pool`` holds beyond its live tensors, and how
    it was measured: the free bytes of the pool's own segments (``torch.cuda.memory_snapshot``:
    each segment names its pool), which only replays of the graph reuse. Where the snapshot
    names no segment of the pool: the growth of reserved memory since ``reserved`` beyond the
    growth of allocated memory since ``allocated`` -- a lower bound (``torch.cuda.graph``
    empties the allocator's cache before it captures, so the pool can reuse freed segments)."""
    segments = [s for s in torch.cuda.memory_snapshot() if s.get("segment_pool_id") is not None
                and tuple(s["segment_pool_id"]) == tuple(pool)]  # fmt: skip
    if segments:
        return sum(s["total_size"] - s["allocated_size"] for s in segments), "pool segments"
    live = torch.cuda.memory_allocated() - allocated
    return max(0, torch.cuda.memory_reserved() - reserved - live), "lower bound"


@dataclasses.dataclass
class Traces:
    """An ``fs.jit`` step, counted as ``CompileCounterWithBackend`` counts Dynamo's frames (its
    traces: one per signature)."""

    jitted: Any

    @property
    def frame_count(self) -> int:
        return self.jitted.traces

    def __call__(self, *args):
        return self.jitted(*args)


@dataclasses.dataclass
class PoolCounted:
    """``graphed`` (``fs.cuda_graph``'s callable), with ``pool_extra`` measured after its
    capture (:func:`pool_free_bytes`) and how (``pool_measure``)."""

    graphed: Any
    pool_extra: int = 0
    pool_measure: str = ""

    def __call__(self, *args):
        if self.graphed.graphs:  # captured: nothing to measure
            return self.graphed(*args)
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        out = self.graphed(*args)
        if self.graphed.graphs:
            torch.cuda.synchronize()
            pool = self.graphed.backend.pool
            self.pool_extra, self.pool_measure = pool_free_bytes(pool, allocated, reserved)
        return out


def funcshard_compiled(w: Workload, mesh: DeviceMesh, o: Options) -> Trainer:
    return funcshard(w, mesh, o, compiled=True)


def funcshard_unshard_compiled(w: Workload, mesh: DeviceMesh, o: Options) -> Trainer:
    return funcshard(w, mesh, o, compiled=True, unshard=True)


@dataclasses.dataclass
class Graphed:
    """``trainer``'s whole step captured as one CUDA graph and replayed (a step function).

    The first ``warmup`` calls run eagerly on a side stream (as ``torch.cuda.graph`` asks:
    lazy initialisation, the optimizer's state); the next one captures the step on a static copy
    of its batch; every call from then on copies its batch in and replays. Raises what the
    capture raises, and if the captured step's parameters are not the tensors it started from
    (replays would not train: the graph writes new parameters where no replay reads them).
    ``pool_extra``: the bytes the graph's private pool holds beyond the tensors alive after the
    capture (the activations' and temporaries' slots, kept for every replay;
    :func:`pool_free_bytes`), ``pool_measure``: how they were measured."""

    trainer: Trainer
    warmup: int = 2
    calls: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    batch: tuple[torch.Tensor, ...] = ()
    loss: torch.Tensor | None = None
    pool_extra: int = 0
    pool_measure: str = ""

    def __call__(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.calls += 1
        if self.calls <= self.warmup:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self.trainer.step(batch)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self.graph is None:
            self._capture(batch)
        for static, x in zip(self.batch, batch, strict=True):
            static.copy_(x)
        self.graph.replay()
        return self.loss.clone()

    def _capture(self, batch: tuple[torch.Tensor, ...]) -> None:
        torch.cuda.synchronize()
        before = [t.data_ptr() for t in self.trainer.parameters()]
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        self.batch = tuple(x.clone() for x in batch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.loss = self.trainer.step(self.batch)
        torch.cuda.synchronize()
        if [t.data_ptr() for t in self.trainer.parameters()] != before:
            raise RuntimeError(
                "the captured step returned new parameter tensors, not its inputs updated in "
                "place: replaying the graph would not train (no replay reads the new ones)"
            )
        self.pool_extra, self.pool_measure = pool_free_bytes(graph.pool(), allocated, reserved)
        self.graph = graph


def cuda_graph(variant: Callable[..., Trainer]) -> Callable[..., Trainer]:
    """The variant with its whole step run by :class:`Graphed`."""

    def build(w: Workload, mesh, o: Options) -> Trainer:
        trainer = variant(w, mesh, o)
        return dataclasses.replace(trainer, forward_backward=Graphed(trainer),
                                   optimizer_step=lambda: None)  # fmt: skip

    return build


def plan_for(w: Workload, model: torch.nn.Module, o: Options) -> fs.Plan:
    """funcshard's plan for ``model``: groups by ``w.group_types``, merged if ``o`` says so."""
    if o.recompute == OPS:
        raise ValueError(
            "recompute='ops' (torchtitan's selection of operators) has no funcshard form: a plan "
            "recomputes whole groups; pass True, or the names of the groups to recompute"
        )
    plan = fs.plan(
        model,
        fs.policy.by_type(*w.group_types),
        prefetch=o.prefetch,
        backward_prefetch=o.backward_prefetch,
        reshard_after_forward=o.reshard_after_forward,
        recompute=o.recompute or None,
    )
    if o.merge_bytes is not None:
        plan = fs.merge_groups(plan, model, o.merge_bytes, param_dtype=o.param_dtype)
    return plan


def module_groups(plan: fs.Plan) -> tuple[tuple[str, ...], ...]:
    """The modules owning each group's parameters: FSDP2's grouping for the same plan."""
    owners = lambda g: tuple(dict.fromkeys(p.rpartition(".")[0] for p in g.params))
    return tuple(owners(g) for g in plan.groups if g.name)


Variant = Callable[[Workload, DeviceMesh, Options], Trainer]
VARIANTS: dict[str, Variant] = {
    "plain": plain,
    "plain + CUDA graph": cuda_graph(plain),
    "plain + compile": functools.partial(plain, compiled=True),
    "fsdp2": fsdp2,
    "funcshard": funcshard,
    "fsdp2 + compile": fsdp2_compiled,
    "fsdp2 + compile per block": fsdp2_compiled_blocks,
    "funcshard + compile": funcshard_compiled,
    "funcshard.unshard + compile": funcshard_unshard_compiled,
    "funcshard + fs.jit": functools.partial(funcshard, jitted=True),
    "funcshard + CUDA graph": cuda_graph(funcshard),
    "funcshard + fs.cuda_graph": functools.partial(funcshard, graphed=True),
    "funcshard + compile + fs.cuda_graph": functools.partial(
        funcshard, compiled=True, graphed=True
    ),
    "funcshard + fs.jit + fs.cuda_graph": functools.partial(funcshard, jitted=True, graphed=True),
}
