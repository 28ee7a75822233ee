"""materialize: a meta-device module straight into initialised shards, checked bitwise against
the same module built normally in one process (the independent reference), on real gloo ranks."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import funcshard as fs
from funcshard._runtime._profiling import peak_bytes

from _checks import raises
from _mesh import mesh
from _models import lm_loss, reference_step, shard_of, tokens

VOCAB = 37


class Gated(nn.Module):
    """Own parameter *and* a child, reset at the end of ``__init__`` (as torch.nn layers do):
    drawn after the child, so materialize must visit children first."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, 3)  # 3 rows: fewer than 4 ranks
        self.ln3 = nn.LayerNorm(3)  # smaller than 4 ranks
        self.up = nn.Linear(3, d)
        self.scale = nn.Parameter(torch.empty(()))  # 0-d: replicated
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale, 0.5, 1.5)

    def forward(self, x):
        return x + self.scale * self.up(self.ln3(torch.tanh(self.proj(x))))


class Net(nn.Module):
    """Embedding, Conv1d, LayerNorm, BatchNorm1d, Linear; tied embedding/head; uneven sizes."""

    def __init__(self, d: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.ln = nn.LayerNorm(d)
        self.bn = nn.BatchNorm1d(d)
        self.gated = Gated(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = self.bn(self.ln(h).transpose(1, 2)).transpose(1, 2)
        return self.head(self.gated(h))


def build(cls=Net, seed=0, device="cpu", **kw):
    torch.manual_seed(seed)
    with torch.device(device):
        return cls(**kw)


def gpt2_init(name: str, m: nn.Module) -> None:
    """GPT-2 style: N(0, 0.02) weights, zero biases, residual projections scaled down."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
    if name.endswith(".up"):
        nn.init.normal_(m.weight, 0.0, 0.02 / math.sqrt(2 * 2))


def apply_init(model: nn.Module, init) -> None:
    """The reference for ``init``: on the built model, every module with tensors of its own,
    children first (``Module.apply``'s order)."""
    names = {m: n for n, m in model.named_modules()}
    own = lambda m: next(m.parameters(recurse=False), next(m.buffers(recurse=False), None))
    with torch.no_grad():
        model.apply(lambda m: init(names[m], m) if own(m) is not None else None)


def _compare(sharded, buffers, ref_params, ref_buffers, placements_ref):
    """Failures: keys, placements, local shards and buffers vs the reference, bitwise."""
    failures = []
    if list(sharded) != list(ref_params) or list(buffers) != list(ref_buffers):
        failures.append(("keys", list(sharded), list(ref_params), list(buffers)))
    for k, full in ref_params.items():
        got = sharded[k]
        if got.placements != placements_ref[k].placements or got.shape != full.shape:
            failures.append((k, got.placements, placements_ref[k].placements))
        elif not torch.equal(got.to_local(), shard_of(full, got)):
            failures.append((k, "values"))
        if got.requires_grad != full.requires_grad:
            failures.append((k, "requires_grad"))
    failures += [(k, "buffer") for k, b in ref_buffers.items() if not torch.equal(buffers[k], b)]
    return failures


def equal_to_single_process(mesh_shape, placements, with_init):
    """materialize(meta model) vs the model built normally (and init applied), bitwise."""
    m = mesh(*mesh_shape)
    ref = build()
    if with_init:
        apply_init(ref, gpt2_init)
    rng_ref = torch.rand(4)
    meta = build(device="meta")
    torch.manual_seed(0)
    sharded, buffers = fs.materialize(meta, m, placements, init=gpt2_init if with_init else None)
    failures = []
    if not torch.equal(torch.rand(4), rng_ref):
        failures.append("the random state after differs from after the normal build")
    if not all(t.is_meta for t in [*meta.parameters(), *meta.buffers()]):
        failures.append("module not left on meta")
    if meta.head.weight is not meta.embed.weight:
        failures.append("tie lost")
    ref_params, ref_buffers = fs.extract(ref)
    return failures + _compare(
        sharded, buffers, ref_params, ref_buffers, fs.shard(ref_params, m, placements)
    )


def _shard1(path, t):
    return Shard(1) if t.dim() >= 2 else None


@pytest.mark.parametrize("with_init", [False, True], ids=["reset", "init"])
@pytest.mark.parametrize("placements", [None, _shard1, Replicate()], ids=["S0", "S1", "R"])
def test_equal_to_single_process_2_ranks(world2, placements, with_init):
    assert world2.run(equal_to_single_process, (2,), placements, with_init) == [[], []]


@pytest.mark.parametrize("with_init", [False, True], ids=["reset", "init"])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["fsdp", "hsdp"])
def test_equal_to_single_process_4_ranks(world4, mesh_shape, with_init):
    assert world4.run(equal_to_single_process, mesh_shape, None, with_init) == [[]] * 4


class DrawsInInit(nn.Module):
    """Draws a parameter of its own in ``__init__``, between two children: not replayable."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.pos = nn.Parameter(torch.randn(3, 4))
        self.b = nn.Linear(4, 4)


def _init_pos(name, m):
    if name == "":
        nn.init.normal_(m.pos)


def draws_in_init():
    """Documented inequality: ``b`` differs from the single-process build, because ``pos``'s
    draw is not replayed; the values are what the documented order gives (a, b, then init of
    the root), the same on every rank."""
    m = mesh(dist.get_world_size())
    single = build(DrawsInInit)
    torch.manual_seed(0)
    sharded, _ = fs.materialize(build(DrawsInInit, device="meta"), m, init=_init_pos)
    full = fs.unshard(sharded)
    torch.manual_seed(0)  # the documented order, built by hand
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    pos = torch.empty(3, 4).normal_()
    expected = {"pos": pos, "a.weight": a.weight, "a.bias": a.bias, "b.weight": b.weight}
    expected["b.bias"] = b.bias  # keys in named_parameters() order
    replicated, _ = fs.materialize(
        build(DrawsInInit, device="meta"), m, Replicate(), init=_init_pos
    )
    return (
        list(full) == list(expected)
        and all(torch.equal(full[k], v) for k, v in expected.items())
        and all(torch.equal(replicated[k].to_local(), v) for k, v in expected.items())
        and torch.equal(full["a.weight"], single.a.weight)
        and not torch.equal(full["b.weight"], single.b.weight)
    )


def test_a_draw_outside_reset_parameters_breaks_equality(world2):
    assert world2.run(draws_in_init) == [True, True]


class ReinitsChild(nn.Module):
    """Re-initialises its child in ``__init__``: materialize warns (and cannot replay it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.lin = nn.Linear(4, 4)


class Rotary(nn.Module):
    """A buffer computed from constants in ``__init__``: cannot be recovered from meta (built
    under ``fs.on_meta()``, it is recorded: tests/test_materialize_models.py)."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.register_buffer("cos", self.table(n), persistent=False)

    @staticmethod
    def table(n):
        return torch.cos(torch.arange(n, dtype=torch.float32) / n)


class WithRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rope = Rotary()


def _rope_init(name, m):
    if isinstance(m, Rotary):
        m.cos.copy_(Rotary.table(m.cos.numel()))


class WritesChild(nn.Module):
    """Its ``reset_parameters()`` writes a child's tensor, at the end of ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.gain)
        nn.init.zeros_(self.lin.bias)  # a child's tensor


def warnings_and_buffers():
    m = mesh(dist.get_world_size())
    out = []
    with pytest.warns(UserWarning) as caught:
        sharded, _ = fs.materialize(build(ReinitsChild, device="meta"), m)
    out.append([str(w.message)[:53] for w in caught])
    out.append("the tensors of embed were initialised while built" in str(caught[0].message))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a model that is replayable
        with fs.on_meta() as construction:
            reinits = ReinitsChild()
        torch.manual_seed(0)
        replayed, _ = fs.materialize(reinits, m, construction=construction)
        writes_child, _ = fs.materialize(build(WritesChild, device="meta"), m)
        _, buffers = fs.materialize(build(WithRotary, device="meta"), m, init=_rope_init)
        fs.materialize(build(device="meta"), m)
    ref = build(ReinitsChild)  # the re-initialisation replayed at the same point: bitwise
    out += [torch.equal(fs.unshard(replayed)[k], v) for k, v in fs.extract(ref)[0].items()]
    torch.manual_seed(0)
    out.append(torch.equal(fs.unshard(sharded)["embed.weight"], nn.Embedding(7, 4).weight))
    ref = build(WritesChild)  # the parent's write into its child: replayed
    out += [torch.equal(fs.unshard(writes_child)[k], v) for k, v in fs.extract(ref)[0].items()]
    out.append(torch.equal(buffers["rope.cos"], build(WithRotary).rope.cos))
    return out


def test_warnings_and_computed_buffers(world2):
    expected = [["funcshard.materialize: the tensors of embed were init"], True]
    assert world2.run(warnings_and_buffers) == [expected + [True] * 8] * 2


def _half_pos(name, m):
    if name == "":
        m.pos[0].normal_()


def errors():
    m = mesh(dist.get_world_size())
    meta = lambda cls=DrawsInInit: build(cls, device="meta")
    found = [
        raises(
            lambda: fs.materialize(build(), m),
            ValueError,
            "'embed.weight'",
            "is on cpu",
            'torch.device("meta")',
            "fs.shard(fs.extract(module)[0], mesh)",
        ),
        raises(
            lambda: fs.materialize(meta(), m),
            ValueError,
            "'pos'",
            "the root module",
            "no reset_parameters()",
            "no init was given",
            "init=fn",
            "name == ''",
        ),
        raises(
            lambda: fs.materialize(meta(), m, init=lambda n, mod: None),
            ValueError,
            "'pos'",
            "init did not write",
        ),
        raises(
            lambda: fs.materialize(meta(), m, init=_half_pos),
            ValueError,
            "'pos'",
            "not (fully) initialised",
        ),
        raises(
            lambda: fs.materialize(meta(WithRotary), m),
            ValueError,
            "'rope.cos'",
            "Rotary 'rope'",
            "a table from torch.arange) are recorded if the module is built under `with "
            "fs.on_meta() as construction:`",
        ),
        raises(
            lambda: fs.materialize(
                meta(),
                m,
                init=lambda n, mod: (
                    setattr(mod, "pos", nn.Parameter(torch.zeros(2))) if n == "" else None
                ),
            ),
            ValueError,
            "replaced 'pos'",
            "shape (3, 4)",
        ),
        raises(lambda: fs.materialize(meta(), m, init="normal"), TypeError, "init"),
        raises(
            lambda: fs.materialize(meta(), m, construction={}),
            TypeError,
            "construction must be what `with fs.on_meta() as construction:` gave, got dict",
        ),
        raises(lambda: fs.materialize({"w": torch.ones(2)}, m), TypeError, "nn.Module"),
    ]
    net = meta(Net)
    before = torch.get_rng_state()  # an error in the arguments comes before any random draw
    found.append(raises(lambda: fs.materialize(net, m, Shard(2)), ValueError, "out of range"))
    return [*found, None if torch.equal(torch.get_rng_state(), before) else "rng moved"]


def test_errors(world2):
    for found in world2.run(errors):
        assert found == [None] * len(found), found


def memory(layers, with_init):
    """Peak bytes of materialize, the bytes of this rank's shards, of one layer's parameters,
    and of the whole model."""
    m = mesh(dist.get_world_size())
    d = 256
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(d, d) for _ in range(layers)))

    def init(name, mod):
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, std=0.02)

    init = init if with_init else None
    peak, (sharded, _) = peak_bytes(lambda: fs.materialize(model, m, init=init))
    shards = sum(p.to_local().numel() * 4 for p in sharded.values())
    layer = (d * d + d) * 4
    return peak, shards, layer, layer * layers


@pytest.mark.parametrize("with_init", [False, True], ids=["reset", "init"])
def test_memory_is_shards_plus_one_module(world4, with_init):
    for peak, shards, layer, full in world4.run(memory, 16, with_init):
        # one layer's full tensors at a time, and its chunk cloned from it
        assert peak < shards + 2 * layer, (peak, shards, layer)
        assert peak < full / 2, (peak, full)


def schedule_step():
    """The result feeds fs.schedule: loss and gradients equal the normally built model's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = build(device="meta")
    torch.manual_seed(0)
    sharded, buffers = fs.materialize(meta, mesh(world))
    batch = tokens(rank, vocab=VOCAB)
    plan = fs.plan(meta, fs.policy.by_type(nn.Conv1d, Gated), example_args=(batch,))
    apply = fs.schedule(meta, plan)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="funcshard")
        loss, grads = fs.value_and_grad(lambda p: lm_loss(apply(p, batch, buffers=buffers), batch))(
            sharded
        )
    batches = [tokens(r, vocab=VOCAB) for r in range(world)]
    ref_loss, ref_grads, ref_buffers = reference_step(build(), batches)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    err = max(
        (g.to_local() - shard_of(ref_grads[k], g)).abs().max().item() for k, g in grads.items()
    )
    buf = max((b - ref_buffers[rank][k]).abs().max().item() for k, b in buffers.items())
    return abs(mean.item() / world - ref_loss.item()), err, buf


def test_feeds_schedule_and_value_and_grad(world2):
    for loss_err, grad_err, buf_err in world2.run(schedule_step):
        assert loss_err < 1e-6 and grad_err < 1e-6 and buf_err < 1e-6
