"""The main job: a character-level transformer language model trained with funcshard.

    make train   # torchrun --standalone --nproc-per-node 2 examples/train_lm.py
    torchrun --standalone --nproc-per-node 4 examples/train_lm.py --width 256 --depth 6 --bf16

The text is the source of Python's standard library, which every machine with Python has: its
bytes are the tokens, and every 10th file is held out. The model is built on the meta device and
initialised straight into shards (``fs.materialize``), so no rank ever holds all of it. Each step
runs it one block at a time (``fs.schedule``: FSDP2's schedule, written down as a plan), and
AdamW with warm-up + cosine decay, weight decay on matrices and global-norm clipping updates the
shards in place (``fs.optim.step``). Rank 0 shows a progress bar, evaluates the held-out loss every
``--eval-every`` steps, and ends with a generated sample and a summary line.

``--optimizer muon`` trains the blocks' matrices with Muon (``fs.optim.muon_adamw``: Muon at
``--muon-lr``, AdamW for the embeddings, norms and biases); ``--ema DECAY`` keeps an exponential
moving average of the weights (``fs.optim.ema``) and evaluates it beside them.
``--ckpt-dir DIR --save-every N`` saves the training state; ``--resume`` continues from the newest
checkpoint, bit for bit on the same number of ranks (see [Note: exact resume]). ``--smoke`` is a
tiny configuration that checks its own result: the held-out loss must fall below the entropy of
the text's bytes (what the best model that ignores context reaches). ``main(argv)`` also runs
inside a process group that already exists (``fs.testing``), as the tests do.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import resource
import sys
import sysconfig
import time
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import funcshard as fs


@dataclasses.dataclass(frozen=True)
class Config:
    """Every option of a run; each field is a command-line flag (``--eval-every``, ...)."""

    width: int = 128  # model
    depth: int = 4
    heads: int = 4
    context: int = 64
    dropout: float = 0.0
    steps: int = 800  # training
    batch: int = 32  # sequences per step over all ranks: each rank takes batch / world of them
    lr: float = 3e-3
    optimizer: str = "adamw"  # or "muon": Muon for the blocks' matrices, AdamW for the rest
    muon_lr: float = 0.02
    ema: float = 0.0  # the decay of an average of the weights, evaluated beside them (0: none)
    warmup: int = 80
    weight_decay: float = 0.1
    clip: float = 1.0
    bf16: bool = False  # bf16 parameters in forward and backward, fp32 gradient reduction
    seed: int = 0
    data_mb: float = 4.0  # how much of the standard library to read
    eval_every: int = 200  # evaluation and output
    eval_batches: int = 8
    sample: int = 240  # characters generated at the end
    ckpt_dir: str = ""  # checkpoints
    save_every: int = 0
    resume: bool = False
    stop_at: int = 0  # stop after this step, as if the job were killed (to try --resume)
    timeout_min: float = 10.0
    smoke: bool = False


# A few seconds: what the tests run (`--smoke`); flags given as well override these.
SMOKE = dict(width=32, depth=2, heads=2, context=32, batch=16, steps=100, lr=1e-2, warmup=10,
             data_mb=0.5, eval_every=25, eval_batches=2, sample=80)  # fmt: skip

# Fields that do not change the training trajectory, so a resumed run may change them.
_PER_RUN = {"eval_every", "eval_batches", "sample", "ckpt_dir", "save_every", "resume", "stop_at",
            "timeout_min", "smoke"}  # fmt: skip


def parse(argv: list[str] | None = None) -> Config:
    """The command line as a `Config` (``--smoke`` first sets the `SMOKE` defaults)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    argv = sys.argv[1:] if argv is None else argv
    if "--smoke" in argv:
        parser.set_defaults(**SMOKE)
    return Config(**vars(parser.parse_args(argv)))


# ----------------------------------------------------------------------------- data


class Text(NamedTuple):
    """The corpus as token ids (``uint8``: one token per distinct byte, at most 256)."""

    train: torch.Tensor
    heldout: torch.Tensor
    vocab: bytes  # the byte of each token id
    entropy: float  # of the training bytes, in nats: the loss of the best context-free model
    digest: str  # identifies the text, so that a checkpoint is not resumed on another one


def load_text(megabytes: float) -> Text:
    """The standard library's top-level ``*.py`` files in name order, whole files until there
    are ``megabytes``; every 10th file (or, among fewer than 10, the last) is held out."""
    files, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if size >= megabytes * 2**20 and len(files) >= 2:  # at least one file to hold out
            break
        files.append(path.read_bytes())
        size += len(files[-1])
    everything = b"".join(files)
    vocab = bytes(sorted(set(everything)))
    ids = torch.zeros(256, dtype=torch.uint8)
    ids[list(vocab)] = torch.arange(len(vocab), dtype=torch.uint8)

    def encode(chunks: list[bytes]) -> torch.Tensor:
        return ids[torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()]

    held = {i for i in range(len(files)) if i % 10 == 9} or {len(files) - 1}
    train = encode([f for i, f in enumerate(files) if i not in held])
    heldout = encode([f for i, f in enumerate(files) if i in held])
    p = torch.bincount(train.long(), minlength=len(vocab)).double() / len(train)
    entropy = -(p[p > 0] * p[p > 0].log()).sum().item()
    return Text(train, heldout, vocab, entropy, hashlib.sha256(everything).hexdigest()[:16])


def batch_at(tokens: torch.Tensor, index: int, size: int, length: int, seed: int) -> torch.Tensor:
    """Batch number ``index`` of the run: ``size`` windows of ``length + 1`` tokens (int64).

    A pure function of its arguments: the data position of a run is the number of the next batch.
    This is the *global* batch; each rank trains on its own rows (`rows`)."""
    g = torch.Generator().manual_seed(seed * 2**32 + index)
    starts = torch.randint(0, len(tokens) - length, (size, 1), generator=g)
    return tokens[starts + torch.arange(length + 1)].long()


def rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's equal share of a global batch (see [Note: exact resume])."""
    if len(batch) % world:
        raise ValueError(f"--batch {len(batch)} is not divisible by the {world} ranks")
    n = len(batch) // world
    return batch[rank * n : (rank + 1) * n]


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.drop1, self.drop2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop1(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class LM(nn.Module):
    """A GPT: token and position embeddings, ``depth`` blocks, the head tied to the embedding."""

    def __init__(
        self, vocab: int, width: int, heads: int, depth: int, context: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.drop(self.embed(tokens) + self.pos(positions))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def gpt2_init(depth: int):
    """GPT-2's initialisation, for ``fs.materialize(init=...)``: N(0, 0.02) weights, zero biases,
    the projections into the residual stream scaled down by ``sqrt(2 * depth)``."""

    def init(name: str, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = name.endswith(("proj", "mlp.2"))
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * depth) if residual else 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    return init


def build(cfg: Config, vocab: int, mesh) -> tuple[LM, fs.Plan]:
    """The model on the meta device (shapes only), and its plan: one group per block."""
    with torch.device("meta"):
        model = LM(vocab, cfg.width, cfg.heads, cfg.depth, cfg.context, cfg.dropout)
    full_batch = torch.zeros(cfg.batch, cfg.context, dtype=torch.long, device="meta")
    example = rows(full_batch, mesh.get_rank(), mesh.size())
    return model, fs.plan(model, fs.policy.by_type(Block), example_args=(example,))


def optimizer(cfg: Config) -> fs.optim.GradientTransformation:
    """Clipping, then AdamW (``--optimizer adamw``) or Muon for the blocks' matrices and AdamW
    for the rest (``--optimizer muon``), with warm-up + cosine decay."""

    def schedule(peak: float):
        return fs.optim.warmup_cosine_decay_schedule(
            0.0, peak, cfg.warmup, cfg.steps, end_value=peak / 10
        )

    adamw = dict(betas=(0.9, 0.95), weight_decay=cfg.weight_decay, mask=fs.optim.at_least_2d)
    if cfg.optimizer == "adamw":
        update = fs.optim.adamw(schedule(cfg.lr), **adamw)
    elif cfg.optimizer == "muon":
        update = fs.optim.muon_adamw(
            schedule(cfg.muon_lr),
            schedule(cfg.lr),
            weight_decay=cfg.weight_decay,
            betas=adamw["betas"],
            adamw_weight_decay=cfg.weight_decay,
            adamw_mask=adamw["mask"],
            is_muon=lambda path, p: p.dim() == 2 and path.startswith("blocks."),
        )
    else:
        raise ValueError(f"--optimizer {cfg.optimizer!r}: choose adamw or muon")
    return fs.optim.chain(fs.optim.clip_by_global_norm(cfg.clip), update)


# ----------------------------------------------------------------------------- steps


def lm_loss(apply, params, buffers, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each next token of ``tokens`` ([b, t + 1])."""
    logits = apply(params, tokens[:, :-1], buffers=buffers)
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def train_step(apply, opt, params, buffers, opt_state, tokens):
    """One step on this rank's rows: sharded gradients (averaged over ranks), then the donated
    optimizer step (``params`` and ``opt_state`` are updated in place and returned; with
    ``--ema``, ``opt_state`` is ``(optimizer state, EmaState)`` and the average follows)."""
    loss, grads = fs.value_and_grad(lambda p: lm_loss(apply, p, buffers, tokens))(params)
    if isinstance(opt, Averaged):
        state, average = opt_state
        params, state = fs.optim.step(opt.opt, params, grads, state)
        return params, (state, opt.ema.update_inplace(average, params)), loss
    params, opt_state = fs.optim.step(opt, params, grads, opt_state)
    return params, opt_state, loss


class Averaged(NamedTuple):
    """``--ema``: the optimizer, and the average of the weights that follows it."""

    opt: fs.optim.GradientTransformation
    ema: fs.optim.Ema

    def init(self, params):
        return self.opt.init(params), self.ema.init(params)


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model, apply, params, buffers, text: Text, cfg: Config) -> float:
    """The held-out loss: the same ``eval_batches`` batches every time, split over the ranks."""
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(())
    for i in range(cfg.eval_batches):
        tokens = rows(batch_at(text.heldout, i, cfg.batch, cfg.context, cfg.seed), rank, world)
        total += lm_loss(apply, params, buffers, tokens)
    model.train()
    return mean_over_ranks(total) / cfg.eval_batches


@torch.no_grad()
def generate(model, params, buffers, text: Text, cfg: Config, prompt: str = "def ") -> str | None:
    """A sampled continuation of ``prompt`` (temperature 0.8), on rank 0; ``None`` elsewhere.

    Every rank takes part in gathering the full model (``fs.unshard``, a collective); then rank 0
    runs it alone."""
    full = fs.unshard(params)
    if dist.get_rank() != 0:
        return None
    model.eval()
    ids = torch.tensor([text.vocab.index(b) for b in prompt.encode()])
    g = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.sample):
        logits = fs.functional_call(model, (full, buffers), (ids[None, -cfg.context :],))
        probs = torch.softmax(logits[0, -1] / 0.8, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)])
    model.train()
    return bytes(text.vocab[i] for i in ids).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- checkpoints

# [Note: exact resume]
# A resumed run repeats the steps of an uninterrupted one bit for bit when everything a step
# reads is restored: the parameters; the optimizer state, whose count drives the learning-rate
# schedule; the step; the data position (the number of the next batch: batches are a pure
# function of it); and every rank's random generators (dropout). On another number of ranks the
# *math* is the same -- the global batch is fixed, each rank takes an equal share of its rows,
# and the ranks' gradients are averaged -- but the order of the additions is not: each rank's
# loss averages other rows, the reduce-scatter and the global norm add other partial sums.
# Floating-point addition is not associative, so the results agree to fp32 rounding, not
# bitwise. (With dropout, the masks are drawn per rank, so they differ too.)


def checkpoint_tree(params, buffers, opt_state, step: int, position: int, cfg, text) -> dict:
    """Everything the next step depends on (see [Note: exact resume])."""
    return {
        "params": params,
        "buffers": buffers,
        "opt": opt_state,
        "step": step,
        "data": {"position": position, "text": text.digest},
        "rng": fs.checkpoint.rng_state(),
        "config": _trajectory(cfg),
    }


def _trajectory(cfg: Config) -> str:
    """The options that decide what the run computes (not where it saves or how it reports)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _PER_RUN}
    return json.dumps(fields, sort_keys=True)


def _check_resumable(path: str, cfg: Config, text: Text) -> None:
    """Refuse, with the differences, a checkpoint of another configuration or another text."""
    saved = fs.checkpoint.load(path, {"config": "", "data": {"text": ""}}, strict=False)
    if saved["data"]["text"] != text.digest:
        raise ValueError(
            f"{path} was trained on another text (another Python's standard library, or another "
            "--data-mb): resume it where it was started, or start a new --ckpt-dir"
        )
    theirs, ours = json.loads(saved["config"]), json.loads(_trajectory(cfg))
    diff = [
        f"--{k.replace('_', '-')} {theirs.get(k)} (now {v})"
        for k, v in ours.items()
        if theirs.get(k) != v
    ]
    if diff:
        raise ValueError(
            f"{path} was trained with {', '.join(diff)}: resume with the same options "
            "(a resumed run must compute what the uninterrupted one would), or start a new "
            "--ckpt-dir"
        )


def start(cfg: Config, model: LM, mesh, opt, text: Text):
    """``(params, buffers, opt_state, step, position)``: from the newest checkpoint in
    ``--ckpt-dir`` with ``--resume`` (if there is one), else a fresh initialisation."""
    path = fs.checkpoint.latest(cfg.ckpt_dir) if cfg.resume else None
    if path is None:
        torch.manual_seed(cfg.seed)  # every rank draws the same initial model
        params, buffers = fs.materialize(model, mesh, init=gpt2_init(cfg.depth))
        torch.manual_seed(hash((cfg.seed, mesh.get_rank())))  # each rank its own dropout masks
        return params, buffers, opt.init(params), 0, 0
    _check_resumable(path, cfg, text)
    meta, meta_buffers = fs.extract(model)  # shapes only: a `like` needs no memory
    like_params = fs.shard(meta, mesh)
    like_buffers = {k: torch.empty(b.shape, dtype=b.dtype) for k, b in meta_buffers.items()}
    like = checkpoint_tree(like_params, like_buffers, opt.init(like_params), 0, 0, cfg, text)
    saved = fs.checkpoint.load(path, like)
    fs.checkpoint.set_rng_state(saved["rng"])
    return saved["params"], saved["buffers"], saved["opt"], saved["step"], saved["data"]["position"]


# ----------------------------------------------------------------------------- main


class Result(NamedTuple):
    """What `main` returns on every rank."""

    params: dict  # the final shards
    step: int
    losses: list  # the training loss of each step this run took (mean over ranks)
    heldout: list  # (step, held-out loss) of each evaluation
    vocab: int
    entropy: float  # of the text's bytes: the smoke test's bound
    sample: str | None  # rank 0's generated text
    heldout_ema: list  # with --ema: (step, held-out loss of the average) of each evaluation


def init_distributed(cfg: Config) -> bool:
    """Join the process group that ``torchrun`` describes, or make one of one rank (``python
    train_lm.py``). Returns whether it did (``False``: a group exists, e.g. in ``fs.testing``)."""
    if dist.is_initialized():
        return False
    # [Note: a timeout on every collective]
    # A rank that crashes, hangs or takes another branch leaves the others waiting inside a
    # collective. With a timeout they raise an error naming that collective instead of hanging
    # until someone kills the job. Keep it longer than the longest gap between two collectives
    # (an evaluation, a checkpoint), and shorter than you would wait (gloo's default: 30 min).
    timeout = timedelta(minutes=cfg.timeout_min)
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
    else:
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return True


def peak_mib() -> float:
    """This process's peak resident memory (max RSS: everything, torch's libraries included)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, else KiB


def main(argv: list[str] | None = None) -> Result:
    cfg = parse(argv)
    if cfg.resume and not cfg.ckpt_dir:
        raise ValueError("--resume needs --ckpt-dir: the directory whose newest checkpoint to load")
    created = init_distributed(cfg)
    try:
        return train(cfg)
    finally:
        if created:
            dist.destroy_process_group()


def train(cfg: Config) -> Result:
    """The run, in an initialised process group: every rank calls it."""
    started = time.perf_counter()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, world = mesh.get_rank(), mesh.size()
    say = tqdm.write if rank == 0 else lambda _: None
    text = load_text(cfg.data_mb)
    model, plan = build(cfg, len(text.vocab), mesh)
    dtypes = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16 else {}
    apply = fs.schedule(model, plan, **dtypes)
    opt = optimizer(cfg)
    if cfg.ema:
        opt = Averaged(opt, fs.optim.ema(cfg.ema))
    params, buffers, opt_state, step, position = start(cfg, model, mesh, opt, text)
    say(describe(params, plan, text, world, step))

    losses, heldout, heldout_ema, saving, seconds = [], [], [], None, 0.0
    if step == 0:
        heldout.append((0, evaluate(model, apply, params, buffers, text, cfg)))
        say(
            f"step 0: held-out loss {heldout[-1][1]:.3f} (uniform: {math.log(len(text.vocab)):.3f})"
        )
        if cfg.ema:
            heldout_ema.append((0, heldout[-1][1]))
    bar = tqdm(total=cfg.steps, initial=step, disable=True if rank else None, desc="train")
    while step < (min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps):
        t0 = time.perf_counter()
        tokens = batch_at(text.train, position, cfg.batch, cfg.context, cfg.seed)
        mine = rows(tokens, rank, world)
        params, opt_state, loss = train_step(apply, opt, params, buffers, opt_state, mine)
        step, position = step + 1, position + 1
        losses.append(mean_over_ranks(loss))
        seconds += time.perf_counter() - t0
        speed = len(losses) * cfg.batch * cfg.context / seconds
        bar.set_postfix_str(
            f"loss {losses[-1]:.3f}, {speed:,.0f} tok/s, peak RSS {peak_mib():,.0f} MiB"
        )
        bar.update()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            heldout.append((step, evaluate(model, apply, params, buffers, text, cfg)))
            average = ""
            if cfg.ema:  # the average is evaluated by the same schedule, in place of the weights
                weights = opt_state[1].average
                heldout_ema.append((step, evaluate(model, apply, weights, buffers, text, cfg)))
                average = f" (EMA of the weights: {heldout_ema[-1][1]:.3f})"
            say(f"step {step}: held-out loss {heldout[-1][1]:.3f}{average}")
        if cfg.ckpt_dir and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
            tree = checkpoint_tree(params, buffers, opt_state, step, position, cfg, text)
            saving = fs.checkpoint.async_save(f"{cfg.ckpt_dir}/step_{step:06d}", tree, keep=2)
    bar.close()
    if saving is not None:
        say(f"saved {saving.wait()}")
    sample = generate(model, params, buffers, text, cfg) if step == cfg.steps else None
    result = Result(
        params, step, losses, heldout, len(text.vocab), text.entropy, sample, heldout_ema
    )
    say(summary(result, cfg, seconds, time.perf_counter() - started))
    if cfg.smoke:
        check(result, cfg)
    return result


def describe(params, plan, text: Text, world: int, step: int) -> str:
    n = sum(p.numel() for p in params.values())
    mine = sum(p.to_local().numel() for p in params.values())
    resumed = f"; resumed at step {step}" if step else ""
    return (
        f"{n:,} parameters in {len(plan.groups)} groups, {mine:,} on each of {world} ranks "
        f"(rank 0); {len(text.train):,} training bytes, {len(text.heldout):,} held out, "
        f"vocab {len(text.vocab)}{resumed}"
    )


def summary(result: Result, cfg: Config, seconds: float, wall: float) -> str:
    """The generated sample and one line of numbers."""
    lines = ["-" * 72, result.sample, "-" * 72] if result.sample is not None else []
    if result.losses:
        tokens = len(result.losses) * cfg.batch * cfg.context
        last = sum(result.losses[-10:]) / len(result.losses[-10:])
        lines.append(
            f"{len(result.losses)} steps in {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s; "
            f"{wall:.1f} s in all): train loss {result.losses[0]:.3f} -> {last:.3f} (mean of "
            f"the last 10 steps)"
        )
    if result.heldout:
        (s0, first), (s1, last) = result.heldout[0], result.heldout[-1]
        lines.append(
            f"held-out loss {first:.3f} at step {s0} -> {last:.3f} at step {s1} (uniform: "
            f"{math.log(result.vocab):.3f}; entropy of the bytes: {result.entropy:.3f})"
        )
    if result.heldout_ema:
        step, loss = result.heldout_ema[-1]
        lines.append(f"held-out loss of the EMA of the weights (--ema {cfg.ema}): {loss:.3f} "
                     f"at step {step}")  # fmt: skip
    lines.append(f"peak RSS {peak_mib():,.0f} MiB on rank 0")
    return "\n".join(lines)


def check(result: Result, cfg: Config) -> None:
    """``--smoke``: the held-out loss must end below the entropy of the text's bytes, i.e. below
    what any model that ignores the context can reach.

    Raises:
        RuntimeError: it did not (on every rank: the losses are averaged over ranks).
    """
    if result.step == cfg.steps and not result.heldout[-1][1] < result.entropy:
        raise RuntimeError(
            f"smoke test failed: held-out loss {result.heldout[-1][1]:.3f} after {cfg.steps} "
            f"steps is not below the entropy of the bytes, {result.entropy:.3f}: the model "
            "did not learn to use the context"
        )


if __name__ == "__main__":
    main()
