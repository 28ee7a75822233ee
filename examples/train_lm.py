"""The main job: a character-level transformer language model trained with funcshard.

    make train                                    # = .venv/bin/python examples/train_lm.py
    .venv/bin/python examples/train_lm.py --ranks 4 --width 256 --depth 6 --bf16
    .venv/bin/python examples/train_lm.py --help  # every flag, its default and choices

Run as a script outside ``torchrun``, it checks its flags (a bad value is one usage error, and
``--help`` answers at once: torch is not imported yet), then starts ``--ranks`` ranks on this
machine with torchrun's own launcher (``torch.distributed.run``), each running this file.
Under ``torchrun`` (several machines) it is one rank of the job.

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
checkpoint, bit for bit on the same number of ranks (see [Note: exact resume]). Ctrl-C stops the
run after the current step, saves it (with ``--ckpt-dir``) and prints the command that resumes;
with ``--max-restarts N`` torchrun restarts the ranks when one dies, and they resume from the
newest checkpoint by themselves (see [Note: restarts]). ``--smoke`` is a tiny configuration that
checks its own result: the held-out loss must fall below the entropy of the text's bytes (what
the best model that ignores context reaches). ``main(argv)`` also runs inside a process group
that already exists (``fs.testing``), as the tests do.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import shlex
import signal
import sys
from typing import Any

# [Note: the command line before torch]
# Importing torch takes seconds, and every rank would do it before its first line runs. So the
# command line -- `Config`, its flags and their checks, and the launcher -- comes first and needs
# only the standard library: `--help` answers at once, and a bad value is one usage error from
# the launcher, before any rank starts (not a traceback per rank, then torchrun's own). The
# script's `__main__` guard therefore sits between this part and the imports of the run.


def _flag(default: Any, help: str, **argparse_options: Any) -> Any:
    """A `Config` field: its default, and what ``--help`` says about it."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_options})


@dataclasses.dataclass(frozen=True)
class Config:
    """Every option of a run; each field is a command-line flag (``--eval-every``, ...)."""

    # model
    width: int = _flag(128, "width of the model: the size of each token's vector")
    depth: int = _flag(4, "number of transformer blocks")
    heads: int = _flag(4, "attention heads per block (must divide --width)")
    context: int = _flag(64, "tokens (bytes) the model sees at once")
    dropout: float = _flag(0.0, "dropout probability, in [0, 1)")
    # training
    steps: int = _flag(800, "optimizer steps of the whole run")
    batch: int = _flag(32, "sequences per step over all ranks; each rank takes an equal share")
    lr: float = _flag(3e-3, "peak learning rate (of AdamW)")
    optimizer: str = _flag("adamw", "adamw, or muon: Muon for the blocks' matrices and AdamW "
                           "for the rest", choices=("adamw", "muon"))  # fmt: skip
    muon_lr: float = _flag(0.02, "peak learning rate of Muon (with --optimizer muon)")
    ema: float = _flag(0.0, "decay of an average of the weights, evaluated beside them, in "
                       "[0, 1) (0: no average)")  # fmt: skip
    warmup: int = _flag(80, "steps of linear learning-rate warm-up before the cosine decay "
                        "(a tenth of --steps instead when not shorter than --steps)")  # fmt: skip
    weight_decay: float = _flag(0.1, "AdamW's weight decay, on matrices only")
    clip: float = _flag(1.0, "clip the gradients' global norm to this")
    bf16: bool = _flag(False, "bf16 parameters in forward and backward, fp32 gradient reduction")
    compile: bool = _flag(False, "trace the training step once and compile it (fs.jit, inductor): "
                          "a slower first step, faster steps after")  # fmt: skip
    float8: bool = _flag(False, "float8 training of the blocks' linears (torchao's "
                         "convert_to_float8_training), their weights gathered in float8 "
                         "(docs/low_precision.md)")  # fmt: skip
    seed: int = _flag(0, "seed of the initial model and of the batches")
    data_mb: float = _flag(4.0, "megabytes of the standard library to read as text")
    # evaluation and output
    eval_every: int = _flag(200, "evaluate the held-out loss every this many steps")
    eval_batches: int = _flag(8, "batches per evaluation")
    sample: int = _flag(240, "characters generated at the end (0: none)")
    metrics: str = _flag("", "append each step's training loss and each held-out loss to this "
                         "file, one JSON object a line (rank 0)")  # fmt: skip
    # checkpoints and restarts
    ckpt_dir: str = _flag("", "folder of the checkpoints (none when empty)")
    save_every: int = _flag(0, "save a checkpoint every this many steps (and at the end)")
    resume: bool = _flag(False, "continue from the newest checkpoint in --ckpt-dir")
    stop_at: int = _flag(0, "stop after this step, as if the job were killed (to try --resume)")
    max_restarts: int = _flag(0, "restart the ranks up to this many times when one fails; they "
                              "resume from the newest checkpoint in --ckpt-dir (under torchrun: "
                              "torchrun's --max-restarts)")  # fmt: skip
    ranks: int | None = _flag(None, "ranks to start on this machine (default: 2; under "
                              "torchrun, its --nproc-per-node decides)")  # fmt: skip
    timeout_min: float = _flag(10.0, "minutes a rank waits for the others before failing")
    smoke: bool = _flag(False, "a tiny configuration that checks its own result (the tests')")
    explain: bool = _flag(False, "print the plan and its predicted memory, communication and "
                          "time per rank (fs.explain), then exit without training")  # fmt: skip


# A few seconds: what the tests run (`--smoke`); flags given as well override these.
SMOKE = dict(width=32, depth=2, heads=2, context=32, batch=16, steps=100, lr=1e-2, warmup=10,
             data_mb=0.5, eval_every=25, eval_batches=2, sample=80)  # fmt: skip

# Fields that do not change the training trajectory, so a resumed run may change them.
_PER_RUN = {"eval_every", "eval_batches", "sample", "metrics", "ckpt_dir", "save_every", "resume",
            "stop_at", "max_restarts", "ranks", "timeout_min", "smoke"}  # fmt: skip
_LAUNCHER_DEFAULT_RANKS = 2
_SECTIONS = {"width": "the model", "steps": "training", "eval_every": "evaluation and output",
             "ckpt_dir": "checkpoints, restarts and ranks"}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """The command line: one flag per `Config` field, with its help, default and choices."""
    p = argparse.ArgumentParser(
        prog="train_lm.py",
        usage="%(prog)s [flags]  (every flag: --help)",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    group = p
    for f in dataclasses.fields(Config):
        if f.name in _SECTIONS:
            group = p.add_argument_group(_SECTIONS[f.name])
        flag, options = "--" + f.name.replace("_", "-"), dict(f.metadata)
        if f.type == "bool":
            group.add_argument(flag, action="store_true", **options)
            continue
        if f.default not in ("", None):
            options["help"] += f" (default: {f.default})"
        kind = int if f.name == "ranks" else type(f.default)
        metavar = {int: "N", float: "X"}.get(kind, "DIR" if f.name.endswith("dir") else "FILE")
        if "choices" in options:
            metavar = None
        group.add_argument(flag, type=kind, default=f.default, metavar=metavar, **options)
    return p


def parse(argv: list[str] | None = None, *, world: int | None = None) -> Config:
    """The command line as a `Config` (``--smoke`` first sets the `SMOKE` defaults).

    A bad value (a choice that does not exist, a negative size, ``--resume`` without
    ``--ckpt-dir``, a ``--batch`` that ``--ranks`` or else ``world`` ranks cannot share) is
    argparse's usage error: a message on stderr and ``SystemExit(2)``.
    """
    p = parser()
    argv = sys.argv[1:] if argv is None else argv
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    cfg = Config(**vars(p.parse_args(argv)))
    wrong = problems(cfg, cfg.ranks or world)
    if wrong:
        p.error("; ".join(wrong))
    return cfg


def problems(cfg: Config, world: int | None = None) -> list[str]:
    """What is wrong with ``cfg`` (empty: nothing), each naming its flag and the fix."""
    at_least = {"width": 1, "depth": 1, "heads": 1, "context": 1, "steps": 1, "batch": 1,
                "warmup": 0, "eval_every": 1, "eval_batches": 1, "sample": 0, "save_every": 0,
                "stop_at": 0, "max_restarts": 0, "ranks": 1}  # fmt: skip
    wrong = [
        f"--{name.replace('_', '-')} {getattr(cfg, name)} must be at least {low}"
        for name, low in at_least.items()
        if getattr(cfg, name) is not None and getattr(cfg, name) < low
    ]
    for name in ("lr", "muon_lr", "data_mb", "timeout_min"):
        if not getattr(cfg, name) > 0:
            wrong.append(f"--{name.replace('_', '-')} {getattr(cfg, name)} must be positive")
    for name in ("dropout", "ema"):
        if not 0 <= getattr(cfg, name) < 1:
            wrong.append(f"--{name} {getattr(cfg, name)} must be in [0, 1)")
    if cfg.width >= 1 and cfg.heads >= 1 and cfg.width % cfg.heads:
        wrong.append(f"--heads {cfg.heads} must divide --width {cfg.width}")
    if world and cfg.batch % world:
        wrong.append(f"--batch {cfg.batch} is not divisible by the {world} ranks")
    if cfg.resume and not cfg.ckpt_dir:
        wrong.append("--resume needs --ckpt-dir: the folder whose newest checkpoint to load")
    if cfg.save_every and not cfg.ckpt_dir:
        wrong.append("--save-every needs --ckpt-dir: the folder to save the checkpoints in")
    if cfg.float8 and cfg.width % 16:
        wrong.append(f"--float8 multiplies by float8 matrices in blocks of 16: --width "
                     f"{cfg.width} must be a multiple of 16")  # fmt: skip
    if cfg.float8 and cfg.compile:
        wrong.append("--compile traces the step with fs.jit, which does not take --float8's "
                     "weights (tensor subclasses) yet: leave one of the two out")  # fmt: skip
    if cfg.float8 and importlib.util.find_spec("torchao") is None:
        wrong.append("--float8 needs torchao: pip install torchao")
    return wrong


def warmup_steps(cfg: Config) -> tuple[int, str | None]:
    """The warm-up the run uses, and the line that says so when it is not ``--warmup``: the
    cosine decay needs the warm-up to end before the last step, so a warm-up that does not is
    shortened to a tenth of the run (what the defaults use: 80 of 800 steps)."""
    if cfg.warmup < cfg.steps:
        return cfg.warmup, None
    short = cfg.steps // 10
    return short, (
        f"warm-up: {short} steps, a tenth of --steps {cfg.steps} (--warmup {cfg.warmup} is not "
        "shorter than the run; give --warmup to choose)"
    )


def launch(argv: list[str]) -> int:
    """Outside ``torchrun``: check the flags and the checkpoint folder, then run ``--ranks``
    ranks of this script on this machine with torchrun's launcher; the exit status of the job.

    ``--help`` and usage errors exit here (``SystemExit``) before torch is imported."""
    cfg = parse(argv, world=_LAUNCHER_DEFAULT_RANKS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks that share the cores: 1 thread each
    try:
        return _start_ranks(cfg, argv)
    except KeyboardInterrupt:  # Ctrl-C before torchrun's launcher took over the signal
        print("train_lm.py: stopped by Ctrl-C before the ranks started", file=sys.stderr)
        return 128 + signal.SIGINT


def _start_ranks(cfg: Config, argv: list[str]) -> int:
    import funcshard as fs  # torch, now that the command line is checked

    if cfg.ckpt_dir and (wrong := checkpoint_problem(cfg, fs.checkpoint.latest(cfg.ckpt_dir))):
        parser().error(wrong)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name, logger in logging.Logger.manager.loggerDict.items():
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.ERROR)  # not each signal it forwards: the ranks say it
    world = cfg.ranks or _LAUNCHER_DEFAULT_RANKS
    options = ["--standalone", f"--nproc-per-node={world}", f"--max-restarts={cfg.max_restarts}"]
    try:
        torchrun.run(torchrun.parse_args([*options, os.path.abspath(__file__), *argv]))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = (f"signal {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0
               else f"exit code {failure.exitcode}")  # fmt: skip
        tries = f" (after {cfg.max_restarts} restarts)" if cfg.max_restarts else ""
        print(f"train_lm.py: rank {rank} failed with {how}{tries}; its error is above",
              file=sys.stderr)  # fmt: skip
        return 1
    except SignalException as e:  # Ctrl-C: torchrun passed it on to the ranks, which said the rest
        return 128 + e.sigval
    return 0


def checkpoint_problem(cfg: Config, newest: str | None) -> str | None:
    """Why ``--ckpt-dir`` cannot be used as asked at the start of a run (``None``: it can), given
    its newest checkpoint: ``--resume`` from a folder with none (a new run would silently start
    at step 0), or a new run into a folder that holds another run's checkpoints (a later
    ``--resume``, or a restart before this run's first save, would pick them)."""
    if cfg.resume and newest is None:
        return (
            f"--resume: {cfg.ckpt_dir} holds no checkpoint to resume from: give the --ckpt-dir "
            "that holds the run's checkpoints, or drop --resume to start a new run"
        )
    if not cfg.resume and newest is not None:
        return (
            f"--ckpt-dir {cfg.ckpt_dir} already holds a run's checkpoints (the newest: "
            f"{os.path.basename(newest)}): add --resume to continue it, or give another "
            "--ckpt-dir for a new run"
        )
    return None


class Interrupt:
    """Ctrl-C as data that the training loop reads: ``handle`` is a SIGINT handler that records
    it. See [Note: Ctrl-C]."""

    def __init__(self) -> None:
        self.requested = False

    def handle(self, signum: int, frame: Any) -> None:
        self.requested = True


if __name__ == "__main__":  # see [Note: the command line before torch]
    if "RANK" not in os.environ:
        sys.exit(launch(sys.argv[1:]))
    INTERRUPT = Interrupt()  # a rank: from here on, Ctrl-C stops the run after a step
    signal.signal(signal.SIGINT, INTERRUPT.handle)

import functools  # noqa: E402 (the run: see [Note: the command line before torch])
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from tqdm import tqdm  # noqa: E402

import funcshard as fs  # noqa: E402

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
    """The model on the meta device (shapes only), and its plan: one group per block. With
    ``--float8``, the blocks' linears are float8 training's (``fs.materialize`` makes their
    weights as such, and each group gathers them in float8: docs/low_precision.md)."""
    with torch.device("meta"):
        model = LM(vocab, cfg.width, cfg.heads, cfg.depth, cfg.context, cfg.dropout)
    if cfg.float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            module_filter_fn=lambda _, fqn: fqn.startswith("blocks."),  # not the tied head
            config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
        )
    full_batch = torch.zeros(cfg.batch, cfg.context, dtype=torch.long, device="meta")
    example = rows(full_batch, mesh.get_rank(), mesh.size())
    return model, fs.plan(model, fs.policy.by_type(Block), example_args=(example,))


def optimizer(cfg: Config) -> fs.optim.GradientTransformation:
    """Clipping, then AdamW (``--optimizer adamw``) or Muon for the blocks' matrices and AdamW
    for the rest (``--optimizer muon``), with warm-up (`warmup_steps`) + cosine decay."""

    def schedule(peak: float):
        return fs.optim.warmup_cosine_decay_schedule(
            0.0, peak, warmup_steps(cfg)[0], cfg.steps, end_value=peak / 10
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
    return next_token_loss(apply(params, tokens[:, :-1], buffers=buffers), tokens)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``logits`` ([b, t, vocab]) against ``tokens[:, 1:]``."""
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def explained(apply, opt, params, buffers, tokens) -> fs.Explanation:
    """This rank's step on ``tokens`` predicted by ``fs.explain``: memory, collectives, time
    (nothing computed or communicated; docs/explain.md)."""
    return fs.explain(
        apply,
        params,
        tokens[:, :-1],
        buffers=buffers,
        optimizer=opt.opt if isinstance(opt, Averaged) else opt,
        loss=lambda logits, _: next_token_loss(logits, tokens),
    )


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
        raise Refused(
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
        raise Refused(
            f"{path} was trained with {', '.join(diff)}: resume with the same options "
            "(a resumed run must compute what the uninterrupted one would), or start a new "
            "--ckpt-dir"
        )


class Refused(ValueError):
    """A run that cannot start as asked: the message says why and what to give instead."""


# [Note: restarts]
# Under `torchrun --max-restarts N` (the launcher's `--max-restarts`), a rank that dies makes
# torchrun stop the others and start the whole group again, with TORCHELASTIC_RESTART_COUNT set
# to the number of the restart. A restarted rank resumes from the newest checkpoint in
# --ckpt-dir as --resume would, without being asked: so one command survives the deaths of
# ranks, and by [Note: exact resume] the restarted run then computes exactly what an
# uninterrupted run from that checkpoint computes. A restart before the first save starts again
# from step 0, and so does every restart without --ckpt-dir; a line says which. A new run refuses
# a --ckpt-dir that holds another run's checkpoints (`checkpoint_problem`), so that a restart
# never picks those up.


def start(cfg: Config, model: LM, mesh, opt, text: Text, restart: int = 0):
    """``(params, buffers, opt_state, step, position, how)``: from the newest checkpoint in
    ``--ckpt-dir`` with ``--resume`` or on a restart (``restart > 0``: see [Note: restarts]),
    else a fresh initialisation; ``how`` is a line saying which (or ``None``).

    Raises:
        Refused: see `checkpoint_problem` and `_check_resumable`.
    """
    newest = fs.checkpoint.latest(cfg.ckpt_dir) if cfg.ckpt_dir else None
    if not restart and (wrong := checkpoint_problem(cfg, newest)):
        raise Refused(wrong)
    how = None
    if restart:
        where = f"no checkpoint in {cfg.ckpt_dir} yet" if cfg.ckpt_dir else "no --ckpt-dir"
        how = f"torchrun restarted the ranks (restart {restart}): " + (
            f"resuming from {newest}" if newest else f"{where}, so starting again from step 0"
        )
    if not (cfg.resume or restart) or newest is None:
        torch.manual_seed(cfg.seed)  # every rank draws the same initial model
        params, buffers = fs.materialize(model, mesh, init=gpt2_init(cfg.depth))
        torch.manual_seed(hash((cfg.seed, mesh.get_rank())))  # each rank its own dropout masks
        return params, buffers, opt.init(params), 0, 0, how
    _check_resumable(newest, cfg, text)
    meta, meta_buffers = fs.extract(model)  # shapes only: a `like` needs no memory
    like_params = fs.shard(meta, mesh)
    like_buffers = {k: torch.empty(b.shape, dtype=b.dtype) for k, b in meta_buffers.items()}
    like = checkpoint_tree(like_params, like_buffers, opt.init(like_params), 0, 0, cfg, text)
    saved = fs.checkpoint.load(newest, like)
    fs.checkpoint.set_rng_state(saved["rng"])
    step, position = saved["step"], saved["data"]["position"]
    return saved["params"], saved["buffers"], saved["opt"], step, position, how


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
    interrupted: bool = False  # Ctrl-C stopped the run (after `step`)
    saved: str | None = None  # the last checkpoint this run saved
    explanation: fs.Explanation | None = None  # with --explain: this rank's predicted step


def init_distributed(cfg: Config, restart: int = 0) -> bool:
    """Join the process group that ``torchrun`` describes (its attempt number ``restart``), or
    make one of one rank (``main`` called outside torchrun). Returns whether it did (``False``: a
    group exists, e.g. in ``fs.testing``)."""
    if dist.is_initialized():
        return False
    # [Note: a timeout on every collective]
    # A rank that crashes, hangs or takes another branch leaves the others waiting inside a
    # collective. With a timeout they raise an error naming that collective instead of hanging
    # until someone kills the job. Keep it longer than the longest gap between two collectives
    # (an evaluation, a checkpoint), and shorter than you would wait (gloo's default: 30 min).
    timeout = timedelta(minutes=cfg.timeout_min)
    if "RANK" in os.environ:
        # [Note: a store per attempt]
        # torchrun's agent keeps one store for all its attempts, and the ranks of a restarted
        # attempt publish their addresses under the same keys as the ranks that died: a rank
        # may read a dead one's address and fail to connect ("Gloo connectFullMesh failed ...
        # Connection refused"), in the default group or in one made later (the checkpoints'
        # background group). Prefixing the keys with the attempt keeps the attempts apart.
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"train_lm/attempt_{restart}", store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return True


def peak_mib() -> float:
    """This process's peak resident memory (max RSS: everything, torch's libraries included)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, else KiB


def main(argv: list[str] | None = None, interrupt: Interrupt | None = None) -> Result:
    """One rank of the run: ``argv`` (default ``sys.argv[1:]``) as on the command line. Under
    torchrun it joins the group torchrun describes; in a process group that exists already
    (``fs.testing``) it runs in that one. ``interrupt`` is the script's Ctrl-C flag.

    Raises:
        SystemExit: a bad flag (argparse's usage error).
        Refused: the checkpoint folder or the number of ranks does not fit the flags.
    """
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse(argv)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    created = init_distributed(cfg, restart)
    try:
        result = train(cfg, interrupt or Interrupt(), restart)
        if result.interrupted and dist.get_rank() == 0:
            print(stopped(cfg, result, argv, dist.get_world_size()), flush=True)
        return result
    finally:
        if created:
            dist.destroy_process_group()


# [Note: Ctrl-C]
# Ctrl-C in a terminal reaches torchrun's launcher, which sends SIGINT to every rank. A rank's
# handler only records it (`Interrupt`); the record rides in the all-reduce of each step's loss,
# so all ranks see it after the same step, stop there together, save that step (with
# --ckpt-dir) and end without a traceback; rank 0 prints the step and the command that resumes.
# No rank leaves a collective half done, so the checkpoint is the state after a whole step.


def train(cfg: Config, interrupt: Interrupt, restart: int = 0) -> Result:
    """The run, in an initialised process group: every rank calls it. ``restart``: how many
    times torchrun restarted the ranks (see [Note: restarts])."""
    started = time.perf_counter()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, world = mesh.get_rank(), mesh.size()
    if cfg.ranks is not None and cfg.ranks != world:
        raise Refused(
            f"--ranks {cfg.ranks}, but the job has {world} ranks (torchrun's --nproc-per-node "
            "decides them under torchrun): drop --ranks"
        )
    say = tqdm.write if rank == 0 else lambda _: None
    record = metrics_writer(cfg.metrics, rank)
    text = load_text(cfg.data_mb)
    model, plan = build(cfg, len(text.vocab), mesh)
    dtypes = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16 else {}
    apply = fs.schedule(model, plan, **dtypes)
    opt = optimizer(cfg)
    if cfg.ema:
        opt = Averaged(opt, fs.optim.ema(cfg.ema))
    params, buffers, opt_state, step, position, how = start(cfg, model, mesh, opt, text, restart)
    for line in (how, describe(params, plan, text, world, step), warmup_steps(cfg)[1]):
        if line:
            say(line)
    record(start=step, restart=restart)
    if cfg.explain:
        tokens = rows(batch_at(text.train, position, cfg.batch, cfg.context, cfg.seed), rank, world)
        explanation = explained(apply, opt, params, buffers, tokens)
        say(f"{plan}\n\n{explanation}")
        return Result(
            params, step, [], [], len(text.vocab), text.entropy, None, [], explanation=explanation
        )

    run_step = functools.partial(train_step, apply, opt)
    if cfg.compile:  # traced once, compiled by inductor: docs/compile.md
        run_step = fs.jit(run_step)
    losses, heldout, heldout_ema, saving, seconds = [], [], [], None, 0.0
    if step == 0:
        heldout.append((0, evaluate(model, apply, params, buffers, text, cfg)))
        record(step=0, heldout=heldout[-1][1])
        say(
            f"step 0: held-out loss {heldout[-1][1]:.3f} (uniform: {math.log(len(text.vocab)):.3f})"
        )
        if cfg.ema:
            heldout_ema.append((0, heldout[-1][1]))
    bar = tqdm(total=cfg.steps, initial=step, disable=True if rank else None, desc="train")
    interrupted = False
    while not interrupted and step < (min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps):
        t0 = time.perf_counter()
        tokens = batch_at(text.train, position, cfg.batch, cfg.context, cfg.seed)
        mine = rows(tokens, rank, world)
        params, opt_state, loss = run_step(params, buffers, opt_state, mine)
        step, position = step + 1, position + 1
        mean, interrupted = mean_and_any(loss, interrupt.requested)
        losses.append(mean)
        record(step=step, loss=mean)
        seconds += time.perf_counter() - t0
        speed = len(losses) * cfg.batch * cfg.context / seconds
        bar.set_postfix_str(
            f"loss {losses[-1]:.3f}, {speed:,.0f} tok/s, peak RSS {peak_mib():,.0f} MiB"
        )
        bar.update()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            heldout.append((step, evaluate(model, apply, params, buffers, text, cfg)))
            record(step=step, heldout=heldout[-1][1])
            average = ""
            if cfg.ema:  # the average is evaluated by the same schedule, in place of the weights
                weights = opt_state[1].average
                heldout_ema.append((step, evaluate(model, apply, weights, buffers, text, cfg)))
                average = f" (EMA of the weights: {heldout_ema[-1][1]:.3f})"
            say(f"step {step}: held-out loss {heldout[-1][1]:.3f}{average}")
        due = step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0) or interrupted
        if cfg.ckpt_dir and due:
            tree = checkpoint_tree(params, buffers, opt_state, step, position, cfg, text)
            saving = fs.checkpoint.async_save(f"{cfg.ckpt_dir}/step_{step:06d}", tree, keep=2)
    bar.close()
    saved = saving.wait() if saving is not None else None
    if saved:
        say(f"saved {saved}")
    sample = generate(model, params, buffers, text, cfg) if step == cfg.steps else None
    result = Result(
        params, step, losses, heldout, len(text.vocab), text.entropy, sample, heldout_ema,
        interrupted, saved,
    )  # fmt: skip
    say(summary(result, cfg, seconds, time.perf_counter() - started))
    if cfg.smoke:
        check(result, cfg)
    return result


def mean_and_any(loss: torch.Tensor, flag: bool) -> tuple[float, bool]:
    """This step's loss averaged over the ranks, and whether any rank raised ``flag`` (Ctrl-C):
    one all-reduce, the one that averaging the loss needs anyway (see [Note: Ctrl-C])."""
    both = torch.stack([loss.detach().float(), torch.tensor(float(flag))])
    dist.all_reduce(both)
    return both[0].item() / dist.get_world_size(), both[1].item() > 0


def metrics_writer(path: str, rank: int):
    """``record(**fields)``: append ``fields`` to ``path`` as one JSON line, on rank 0 (elsewhere,
    or without a path, nothing). Each line is written whole, so a rank that dies leaves whole
    lines; a restarted run appends after them."""
    if not path or rank:
        return lambda **_: None

    def record(**fields) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")

    return record


def stopped(cfg: Config, result: Result, argv: list[str], world: int) -> str:
    """What rank 0 prints after Ctrl-C: the step, the checkpoint, and the command that resumes."""
    where = f"stopped by Ctrl-C after step {result.step} of {cfg.steps}"
    if result.saved is None:
        return (
            f"{where}; nothing was saved (no --ckpt-dir): to be able to resume a run, give it "
            "--ckpt-dir DIR (and --save-every N)"
        )
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:  # ranks on several machines
        return f"{where}; saved {result.saved}. To resume: the same torchrun command + --resume"
    args = [*argv, "--resume"] if "--resume" not in argv else list(argv)
    if "--ranks" not in args and world != _LAUNCHER_DEFAULT_RANKS:
        args += ["--ranks", str(world)]
    command = [_short(sys.executable), _short(__file__), *args]
    return f"{where}; saved {result.saved}. To resume:\n  {shlex.join(command)}"


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    relative = os.path.relpath(os.path.abspath(path))
    return os.path.abspath(path) if relative.startswith("..") else relative


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
        change = f"{first:.3f} at step {s0} -> " if len(result.heldout) > 1 else ""
        lines.append(
            f"held-out loss {change}{last:.3f} at step {s1} (uniform: "
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


def run_rank(interrupt: Interrupt) -> int:
    """The script as one rank (under torchrun): its exit status. A `Refused` run is one message
    (from rank 0), not a traceback per rank; Ctrl-C is 130."""
    try:
        result = main(interrupt=interrupt)
    except Refused as e:
        if os.environ.get("RANK") == "0":
            print(f"train_lm.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 128 + signal.SIGINT if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(run_rank(INTERRUPT))
