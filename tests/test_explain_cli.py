"""``python -m funcshard.explain`` on tiny models over a fake world of 8 ranks, the largest-batch
search against hand computations and a brute-force scan, and a fake world of shape (2, 4)."""

import contextlib
import io
import json
import re
import runpy
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import funcshard as fs
from funcshard._pricing._explain_scale import largest_batch, parse_bytes
from funcshard._pricing._fake_world import fake_world
from funcshard._runtime._compat import all_gather_single

VOCAB, WIDTH, BLOCKS = 256, 64, 3


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def tiny_lm() -> nn.Module:
    """The CLI's ``--model test_explain_cli:tiny_lm``."""
    return TinyLM()


def cli(*argv: str) -> str:
    """``python -m funcshard.explain argv``, in this process; its stdout."""
    out = io.StringIO()
    old = sys.argv
    sys.argv = ["funcshard.explain", *argv]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            runpy.run_module("funcshard.explain", run_name="__main__")
    finally:
        sys.argv = old
    assert exit_.value.code == 0, out.getvalue()
    assert not dist.is_initialized()  # the fake world is gone
    assert callable(fs.explain)  # the command module did not shadow the function
    return out.getvalue()


def answers(text: str) -> tuple[bool, int]:
    fits = re.search(r"fits in \S+ per rank at batch \d+: (yes|no)", text)
    best = re.search(r"largest batch that fits: (\d+)", text)
    assert fits and best, text
    return fits.group(1) == "yes", int(best.group(1))


def test_cli_factory_model(tmp_path):
    """The tiny LM over 8 fake ranks: groups per block, embedding and head; the fit answer and
    the largest batch agree with the peaks the explains reported (N fits, N + 1 does not)."""
    path = tmp_path / "e.json"
    budget = 2_000_000
    text = cli(
        *("--model", "test_explain_cli:tiny_lm", "--world", "8", "--seq", "64"),
        *("--budget", f"{budget}B", "--json", str(path)),
    )
    assert "groups: Block, embed, head; world 8 (fake)" in text
    assert "Explanation: rank 0 of 8" in text
    fits, best = answers(text)
    data = json.loads(path.read_text())
    peaks = {int(b): p for b, p in data["answers"]["peak_bytes_by_batch"].items()}
    assert fits == (data["peak_bytes"] <= budget) == (peaks[1] <= budget)
    assert best == data["answers"]["largest_batch"] > 1
    assert peaks[best] <= budget < peaks[best + 1]
    # the shards: 1/8 of each fp32 parameter, gathered in bf16 (the default --param-dtype)
    block = next(g for g in data["groups"] if g["name"] == "blocks.0")
    n = 2 * 4 * WIDTH * WIDTH + 5 * WIDTH
    assert block["params"] == 4  # tensors: two weights, two biases
    assert block["shard_bytes"] == 4 * n // 8 and block["gathered_bytes"] == 2 * n


def test_cli_hf_config():
    """A tiny Llama from a transformers config with overrides, 8 fake ranks, no search."""
    overrides = "hidden_size=128,intermediate_size=256,num_hidden_layers=2,"
    overrides += "num_attention_heads=4,num_key_value_heads=2,vocab_size=512"
    text = cli(
        *("--hf-config", "llama", "--hf-override", overrides, "--world", "8", "--seq", "32"),
        *("--budget", "1GB", "--no-search", "--optimizer", "none"),
    )
    assert "groups: LlamaDecoderLayer, model.embed_tokens, lm_head" in text
    assert "fits in 1GB per rank at batch 1: yes" in text
    assert "model.layers.1" in text and "optimizer state" not in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--model", "test_explain_cli:nope"), "has no attribute 'nope'"),
        (("--model", "tiny_lm"), "expected module:function"),
        (("--model", "test_explain_cli:tiny_lm", "--world", "3y"), "expected N or RxS"),
        (("--model", "test_explain_cli:tiny_lm", "--policy", "Foo"), "classes: ['Block'"),
        (("--model", "test_explain_cli:tiny_lm", "--budget", "lots"), "80GiB"),
        (("--hf-config", '{"hidden_size": 8}'), "needs a model_type"),
    ],
)
def test_cli_usage_errors(argv, message, capsys):
    """Bad arguments end as usage errors (exit status 2) that name the argument and the fix."""
    old = sys.argv
    sys.argv = ["funcshard.explain", *argv]
    try:
        with pytest.raises(SystemExit) as exit_:
            runpy.run_module("funcshard.explain", run_name="__main__")
    finally:
        sys.argv = old
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized()


def test_largest_batch_linear():
    """peak = 1000 + 300 b, budget 10000: b <= 9000 / 300 = 30, found in four explains
    (batches 1 and 2 give the line, 30 and 31 confirm it)."""
    tried = []

    def make(b):
        tried.append(b)
        return _Peak(1000 + 300 * b)

    assert largest_batch(make, 10_000) == 30
    assert tried == [1, 2, 30, 31]
    assert largest_batch(lambda b: _Peak(1000 + 300 * b), 1000 + 300 * 7) == 7  # exactly at
    assert largest_batch(lambda b: _Peak(20_000 * b), 10_000) == 0  # batch 1 does not fit
    assert largest_batch(lambda b: _Peak(5), 10, limit=64) == 64  # the peak does not grow


def test_largest_batch_convex():
    """The peak moves from a flat moment to a steep one: max(5000 + 10 b, 100 b) <= 10000 at
    b <= 100 (the steep one), not the 500 that batches 1 and 2 extrapolate."""
    assert largest_batch(lambda b: _Peak(max(5000 + 10 * b, 100 * b)), 10_000) == 100


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**4)), min_size=1, max_size=4),
    st.integers(1, 10**7),
)
def test_largest_batch_matches_a_scan(lines, budget):
    """Any peak that is a max of lines (non-decreasing): the scan's answer, in few explains."""
    calls = []

    def peak(b):
        calls.append(b)
        return _Peak(max(a + s * b for a, s in lines))

    limit = 5000
    scan = 0
    while scan < limit and max(a + s * (scan + 1) for a, s in lines) <= budget:
        scan += 1
    assert largest_batch(peak, budget, limit=limit) == scan
    assert len(calls) == len(set(calls)) <= 30


def test_parse_bytes():
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("1.5GiB") == 1.5 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("4096") == 4096
    for bad in ("80 parsecs", "-1GB", "GB", "0"):
        with pytest.raises(ValueError, match="80GiB"):
            parse_bytes(bad)


def test_fake_world_2x4():
    """An HSDP mesh (replicate 2 x shard 4) of 8 fake ranks, this process rank 5: coordinate
    (1, 1); a shard is a quarter of the rows, replicated over the first dim; each dim's group
    has its size, and collectives on it return at once."""
    with fake_world((2, 4), rank=5, names=("replicate", "shard")) as mesh:
        assert dist.get_world_size() == 8 and dist.get_rank() == 5
        assert mesh.shape == (2, 4) and tuple(mesh.get_coordinate()) == (1, 1)
        w = fs.shard({"w": torch.empty(8, 3, device="meta")}, mesh)["w"]
        assert w.placements == (Replicate(), Shard(0))
        assert w.to_local().shape == (2, 3) and w.shape == (8, 3)
        assert mesh.get_group("shard").size() == 4 and mesh.get_group("replicate").size() == 2
        x = torch.ones(2, 3)
        out = torch.empty(8, 3)
        all_gather_single(out, x, group=mesh.get_group("shard"))
        dist.all_reduce(x, group=mesh.get_group("replicate"))
        with pytest.raises(ValueError, match="already initialized"), fake_world(8):
            pass
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="rank in"), fake_world((2, 4), rank=8):
        pass


class _Peak:
    def __init__(self, peak_bytes: int) -> None:
        self.peak_bytes = peak_bytes


def test_cli_reshard_to_a_smaller_mesh(tmp_path):
    """``--reshard-to 2`` on 8 ranks: every block's backward all-gather runs over a sub-group
    of 2 ranks, each rank sending half the group; the forward ones over all 8."""
    path = tmp_path / "e.json"
    cli(
        *("--model", "test_explain_cli:tiny_lm", "--world", "8", "--seq", "64"),
        *("--reshard-to", "2", "--no-search", "--json", str(path)),
    )
    data = json.loads(path.read_text())
    gathers = [c for c in data["collectives"] if c["kind"] == "all_gather"]
    backward = [c for c in gathers if c["phase"] == "backward"]
    assert backward and all(c["mesh_dim"] == "sub-group (2 ranks)" for c in backward)
    assert all(c["in_bytes"] * 2 == c["out_bytes"] for c in backward)
    forward = [c for c in gathers if c["phase"] == "forward"]
    assert all(c["mesh_dim"].endswith("(8 ranks)") for c in forward)
    assert {g["reshard_after_forward"] for g in data["groups"] if g["name"]} == {2}


def test_cli_mixture_of_experts():
    """A tiny Mixtral (experts as grouped matmuls, which take only low precision on meta):
    the plan's dry run computes in the groups' param_dtype, as the step does, so the order is
    recorded and every group is used where the plan says (no warning)."""
    overrides = "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
    overrides += "num_key_value_heads=2,vocab_size=512,num_local_experts=4"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = cli(
            *("--hf-config", "mixtral", "--hf-override", overrides, "--world", "8"),
            *("--seq", "32", "--no-search"),
        )
    assert "note:" not in text and "model.layers.1" in text
    assert re.search(r"reduce_scatter\s+model\.layers\.0\s", text)
