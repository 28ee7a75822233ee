"""Recompute groups whose modules return more than tensors, and recomputations that differ from
their forward: a group's output may be any pytree (``None`` and other non-tensor leaves come back
as the forward returned them), and a recompute that would silently differ from the forward (state
written during the forward, e.g. a key/value cache) is an error naming the group, under plain
autograd and inside torch.func transforms."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import grad

import funcshard as fs
from funcshard._runtime._compat import HAS_2_13

from _hf import batch, block_types, build
from _mesh import mesh
from _models import lm_loss, make, reference_step, shard_of, tokens

MODES = ["value_and_grad", "torch_func"]


def _setup(model, policy, **plan_kw):
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    plan = fs.plan(model, fs.policy.by_type(policy), **plan_kw)
    model.to("meta")  # the documented pattern: the module keeps no weights
    return sharded, {k: v.clone() for k, v in buffers.items()}, plan


def _grads(mode, loss, sharded, buffers):
    """``loss(sharded, buffers)``'s gradients for ``sharded``: through ``fs.value_and_grad`` or
    ``torch.func.grad`` (over the local shards), as ``{fqn: DTensor}``."""
    if mode == "value_and_grad":
        return fs.value_and_grad(loss)(sharded, buffers)[1]
    return fs.from_local(grad(loss)(fs.to_local(sharded), buffers))


def _err(grads, ref):
    return max(
        (g.to_local() - shard_of(ref[k], g)).abs().max().item()
        for k, g in grads.items()
        if g.to_local().numel()
    )


# --- outputs that are not tensors -------------------------------------------------------------


class Plural(nn.Module):
    """A block returning a pytree with ``None`` and other non-tensor leaves (as T5's blocks
    return ``(hidden, bias, None)``), optionally with a BatchNorm."""

    def __init__(self, d: int, batchnorm: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d) if batchnorm else nn.Identity()

    def forward(self, x, bias=None):
        b, t, d = x.shape
        h = self.bn(self.fc(x).reshape(b * t, d)).reshape(b, t, d)
        h = torch.tanh(h if bias is None else h + bias)
        return h, None, {"scale": h.mean(), "steps": 2, "none": None, "mask": h > 0}


class PluralNet(nn.Module):
    def __init__(self, vocab=37, d=8, layers=2, batchnorm=True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Plural(d, batchnorm) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        h, bias = self.embed(tokens), None
        for block in self.blocks:
            h, nothing, extra = block(h, bias)
            assert nothing is None and extra["none"] is None and extra["steps"] == 2
            assert extra["mask"].dtype == torch.bool
            h, bias = h * extra["scale"], extra["mask"].float()
        return self.head(h)


def plural(mode, batchnorm):
    """Recomputed blocks returning ``(hidden, None, {...})``: the unsharded model's gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make(PluralNet, batchnorm=batchnorm)
    sharded, buffers, plan = _setup(model, Plural, recompute=True)
    apply = fs.schedule(model, plan)
    batch = tokens(rank)
    loss = lambda p, bufs: lm_loss(apply(p, batch, buffers=bufs), batch)
    grads = _grads(mode, loss, sharded, buffers)
    reference = make(PluralNet, batchnorm=batchnorm)
    _, ref, _ = reference_step(reference, [tokens(r) for r in range(world)])
    return _err(grads, ref)


@pytest.mark.parametrize("batchnorm", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_outputs_that_are_not_tensors(world2, mode, batchnorm):
    """With BatchNorm the group runs through funcshard's Function under plain autograd too;
    without, through torch.utils.checkpoint."""
    assert max(world2.run(plural, mode, batchnorm)) < 1e-6


# --- Hugging Face models with their default use_cache=True -----------------------------------


def hf_recompute(name: str, mode: str, **kw) -> tuple[float, list[str]]:
    """A recomputing plan on a Hugging Face model with ``use_cache=True``: the largest
    difference from the unsharded model's gradients, and the warnings."""
    model = build(name)  # T5's blocks return ``(hidden, position_bias, None)``
    assert model.config.use_cache
    b = {**batch("whisper" if name == "whisper" else "gpt2", dist.get_rank()), **kw}
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    plan = fs.plan(model, fs.policy.by_type(*block_types(model)), recompute=True)
    model.to("meta")
    assert sum(g.recompute for g in plan.groups) == len(plan.groups) - 1
    apply = fs.schedule(model, plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = _grads(mode, lambda p, bufs: apply(p, buffers=bufs, **b).loss, sharded, buffers)
    reference = build(name)
    b.pop("use_cache", None)  # the reference writes its cache once: right without it
    _, ref = fs.testing.reference_value_and_grad(
        lambda p, b: fs.functional_call(reference, (p, buffers), (), b).loss,
        {k: v.full_tensor() for k, v in sharded.items()},
        b,
    )
    err = max(  # not the frozen ones (Whisper's positions): None
        (g.full_tensor() - ref[k]).abs().max().item() for k, g in grads.items() if g is not None
    )
    return err, [str(w.message) for w in caught if "recomputes in backward" in str(w.message)]


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
@pytest.mark.parametrize("mode", MODES)
def test_hugging_face_models_recompute_without_their_cache(world2, mode, name):
    """With ``use_cache=True`` (the default) the recompute would write the key/value cache a
    second time (silently wrong gradients under torch.func): the layers run without a cache,
    as Hugging Face's own gradient checkpointing runs them, with a warning naming the layer."""
    for err, warned in world2.run(hf_recompute, name, mode):
        assert err < 1e-5, err
        assert warned and all("use_cache=False" in w for w in warned), warned
        layer = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer", "t5": "T5Block"}[name]
        assert f"funcshard: {layer} recomputes in backward" in warned[0]


@pytest.mark.parametrize("mode", MODES)
def test_layers_without_a_cache_recompute_without_a_warning(world2, mode):
    """Whisper's encoder layers have no cache (``use_cache`` reaches them only inside their
    ``**kwargs``): no warning names them; its decoder layers, which have one, still warn."""
    for err, warned in world2.run(hf_recompute, "whisper", mode):
        assert err < 1e-5, err
        assert warned and all(w.startswith("funcshard: WhisperDecoderLayer ") for w in warned)


def test_use_cache_false_runs_without_a_warning(world2):
    for err, warned in world2.run(hf_recompute, "gpt2", "torch_func", use_cache=False):
        assert err < 1e-5 and not warned, (err, warned)


# --- a module that writes state during its forward -------------------------------------------


class Caching(nn.Module):
    """Attention that appends its keys to a cache kept on the module (as a key/value cache
    does) and attends over the cache: recomputed, it would see its keys twice."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.k = nn.Linear(d, d)
        self.cache: torch.Tensor | None = None

    def forward(self, x):
        k = self.k(x)
        if self.cache is not None:
            k = torch.cat([self.cache, k], 1)
        self.cache = k
        return x + (x @ k.transpose(1, 2)).softmax(-1) @ k


class CachingNet(nn.Module):
    def __init__(self, vocab=37, d=8, layers=2, batchnorm=False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Caching(d) for _ in range(layers))
        self.bn = nn.BatchNorm1d(d) if batchnorm else nn.Identity()
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            block.cache = None  # a new cache for each call
            h = block(h)
        return self.head(self.bn(h.transpose(1, 2)).transpose(1, 2))


class Counting(nn.Module):
    """A block that keeps a running value on the module and computes with it: the same shapes
    in the recompute, other values."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.state: torch.Tensor | None = None

    def forward(self, x):
        h = self.fc(x)
        self.state = h.mean() if self.state is None else self.state + h.mean()
        return torch.tanh(h) * self.state


class CountingNet(CachingNet):
    def __init__(self, vocab=37, d=8, layers=2) -> None:
        super().__init__(vocab, d, layers)
        self.blocks = nn.ModuleList(Counting(d) for _ in range(layers))

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            block.state = None
            h = block(h)
        return self.head(h)


def state_written(net, block, mode, batchnorm=False):
    """The error a recomputing step raises, on a model whose blocks write state in forward."""
    torch.manual_seed(0)
    model = net() if net is CountingNet else net(batchnorm=batchnorm)
    sharded, buffers, plan = _setup(model, block, recompute=True)
    apply = fs.schedule(model, plan)
    b = tokens(dist.get_rank())
    try:
        _grads(mode, lambda p, bufs: lm_loss(apply(p, b, buffers=bufs), b), sharded, buffers)
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batchnorm", [False, True])
def test_a_recompute_reading_its_forwards_cache_is_an_error(world2, mode, batchnorm):
    """Under plain autograd, torch.utils.checkpoint's check that the recompute saves the
    tensors the forward saved; in funcshard's Function (torch.func; BatchNorm in the model
    makes no difference to the blocks) the recompute reading a tensor its forward kept. Either
    way: an error naming the group and the likely cause."""
    for message in world2.run(state_written, CachingNet, Caching, mode, batchnorm):
        assert message is not None
        assert "schedule: group 'blocks." in message, message
        assert "which recomputes in backward, recomputed differently from its forward" in message
        assert "writes state during its forward" in message and "use_cache=False" in message


def test_a_recompute_reading_state_of_other_values_is_an_error(world2):
    """Same shapes, other values (nothing torch.utils.checkpoint could see): in funcshard's
    Function, the recompute reading what its forward kept is an error."""
    for message in world2.run(state_written, CountingNet, Counting, "torch_func"):
        assert message is not None and "recomputed differently from its forward" in message
        assert "read a tensor of shape () that the forward computed from its inputs" in message


def test_private_torch_checkpoint_apis_the_names_rely_on():
    """``_activation_checkpoint.name_failures`` replaces a checkpoint frame's ``recompute_fn`` and
    ``check_recomputed_tensors_match`` and lets torch's early stop
    (``_StopRecomputationError``) through: fails here first if a torch upgrade changes them."""
    from torch.utils import checkpoint as ckpt

    assert issubclass(ckpt._StopRecomputationError, Exception)
    assert issubclass(ckpt.CheckpointError, RuntimeError)
    assert callable(ckpt._CheckpointFrame.check_recomputed_tensors_match)
    frame = ckpt._CheckpointFrame(print, False, None, None)
    assert frame.recompute_fn is print


@pytest.mark.parametrize("failure", ["saved", "raised", None])
def test_checkpoint_failures_are_named(failure):
    """A ``torch.utils.checkpoint`` region whose recompute saves other tensors (torch's
    ``CheckpointError``) or raises: the error ``name_failures`` makes, from the original; a
    recompute that matches (torch stops it early) is untouched."""
    from torch.utils.checkpoint import CheckpointError, checkpoint

    from funcshard._trees._activation_checkpoint import current_frame, name_failures

    state: list[torch.Tensor] = []

    def fn(x):
        frame = current_frame()  # the region's, in forward; None in its recompute
        if frame is not None:
            name_failures(frame, lambda e: RuntimeError(f"named: {type(e).__name__}"))
        if failure == "raised" and state:
            raise ValueError("the second call")
        k = torch.cat([state[0], x]) if failure == "saved" and state else x
        state.append(k)
        return (k.sin() * 2).sum() + x.cos().sum()

    x = torch.randn(3, requires_grad=True)
    out = checkpoint(fn, x, use_reentrant=False)
    if failure is None:
        (g,) = torch.autograd.grad(out, x)
        torch.testing.assert_close(g, 2 * x.cos() - x.sin())
        return
    with pytest.raises(RuntimeError, match="named") as e:
        out.backward()
    assert isinstance(e.value.__cause__, CheckpointError if failure == "saved" else ValueError)


class LazyMask(nn.Module):
    """Builds a causal mask on first use and keeps it on the module (a lazily built constant, as
    rotary tables are): state written in forward, but not computed from the inputs' values."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.mask: torch.Tensor | None = None

    def forward(self, x):
        t = x.shape[1]
        if self.mask is None or self.mask.shape[0] != t:
            self.mask = x.new_ones(t, t).tril()
        h = self.fc(x)
        return x + (self.mask @ h) / t


class LazyMaskNet(CountingNet):
    def __init__(self, vocab=37, d=8, layers=2) -> None:
        super().__init__(vocab, d, layers)
        self.blocks = nn.ModuleList(LazyMask(d) for _ in range(layers))

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def lazy_constant(mode):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make(LazyMaskNet)
    sharded, buffers, plan = _setup(model, LazyMask, recompute=True)
    apply = fs.schedule(model, plan)
    b = tokens(rank)
    grads = _grads(mode, lambda p, bufs: lm_loss(apply(p, b, buffers=bufs), b), sharded, buffers)
    _, ref, _ = reference_step(make(LazyMaskNet), [tokens(r) for r in range(world)])
    return _err(grads, ref)


@pytest.mark.parametrize("mode", MODES)
def test_state_that_is_not_computed_from_the_inputs_is_allowed(world2, mode):
    """A constant built on first use and kept (a mask, a rotary table) is read by the recompute
    as by the forward: no error, the unsharded model's gradients."""
    assert max(world2.run(lazy_constant, mode)) < 1e-6


# --- under torch.compile ------------------------------------------------------------------------


def compiled(net, block, **kw):
    """A recomputing step under torch.compile (aot_eager): its loss and gradients against the
    eager step's, or the error it raises."""
    model = make(net, **kw)
    sharded, buffers, plan = _setup(model, block, recompute=True)
    apply = fs.schedule(model, plan)
    b = tokens(dist.get_rank())
    vg = fs.value_and_grad(lambda p, bufs, b: lm_loss(apply(p, b, buffers=bufs), b))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c_loss, c_grads = torch.compile(vg, backend="aot_eager", fullgraph=True)(
                sharded, buffers, b
            )
    except Exception as e:  # what funcshard's transform raised while traced: in a warning
        return "\n".join([f"{type(e).__name__}: {e}", *(str(w.message) for w in caught)])
    loss, grads = vg(sharded, buffers, b)
    return max(
        abs(loss.item() - c_loss.item()),
        *((grads[k].to_local() - c_grads[k].to_local()).abs().max().item() for k in grads),
    )


@pytest.mark.skipif(not HAS_2_13, reason="funcshard under torch.compile: torch 2.13")
def test_under_torch_compile(world2):
    """Outputs that are not tensors, from groups holding a BatchNorm, compiled as in eager; a
    recompute reading what its forward kept: the named error, while tracing."""
    assert max(world2.run(compiled, PluralNet, Plural, batchnorm=True)) < 1e-6
    for message in world2.run(compiled, CachingNet, Caching):
        assert isinstance(message, str), message
        assert "raised RuntimeError while torch.compile traced it" in message, message
        assert "group 'blocks.1', which recomputes in backward, recomputed differently" in message
