"""The GPU main job: a Llama-style language model trained with funcshard, on 1..N GPUs.

    torchrun --nproc-per-node 8 examples/train_llama.py --width 1024 --depth 16 --cuda-graph
    python examples/train_llama.py --device cpu --ranks 2 --width 64 --depth 2  # a CPU smoke run
    python examples/train_llama.py --help                                       # every flag

Under ``torchrun`` each process is one rank (NCCL on CUDA, gloo on the CPU). Run as a plain
script it checks its flags first (``--help`` and a bad value answer before torch is imported),
then starts ``--ranks`` ranks on this machine with torchrun's launcher (``torch.distributed.run``).

The model (RMSNorm, attention through SDPA with rotary embeddings, SwiGLU, an untied head) is
built on the meta device and initialised straight into shards (``fs.materialize``); each step
gathers it one block at a time (``fs.schedule``), in bf16 with fp32 gradient reduction and fp32
master weights (``--bf16``, the default on CUDA), and AdamW (fused on CUDA) updates the shards in
place. ``--cuda-graph`` captures the whole step -- gathers, forward, backward, reduce-scatters,
clipping and AdamW -- as one CUDA graph (``fs.cuda_graph``); ``--compile`` traces it once and
compiles it whole (``fs.jit``; with ``--cuda-graph`` too, the compiled step is captured);
``--recompute`` recomputes each block's activations in the backward (``fs.plan(recompute=True)``).
The tokens are the bytes of Python's standard library (``train_lm.load_text``). ``--ckpt-dir`` /
``--save-every`` / ``--resume`` save and continue the run exactly (fs.checkpoint). Rank 0 shows
a progress bar with the loss, tokens/s and the model FLOPs utilisation: 6 x parameters x
tokens/s over ``--peak-tflops`` x ranks ("-" on the CPU).
"""

from __future__ import annotations

import argparse
import os
import sys

# See train_lm.py's [Note: the command line before torch]: flags are checked with the standard
# library only, so --help and usage errors come at once, before any rank imports torch.


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_llama.py", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    add = p.add_argument
    add("--width", type=int, default=256, help="model width (default: 256)")
    add("--depth", type=int, default=4, help="transformer blocks (default: 4)")
    add("--heads", type=int, default=4, help="attention heads, dividing --width (default: 4)")
    add("--context", type=int, default=256, help="tokens per sequence (default: 256)")
    add("--batch", type=int, default=16, help="sequences per step over all ranks (default: 16)")
    add("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    add("--lr", type=float, default=1e-3, help="peak learning rate of AdamW (default: 1e-3)")
    add("--warmup", type=int, default=20, help="warm-up steps, < --steps (default: 20)")
    add("--seed", type=int, default=0, help="seed of the initial model and batches")
    add("--data-mb", type=float, default=4.0, help="megabytes of the stdlib to read (default: 4)")
    add("--device", choices=("cpu", "cuda"), default=None,
        help="where to train (default: cuda if available)")  # fmt: skip
    add("--bf16", action=argparse.BooleanOptionalAction, default=None,
        help="bf16 compute, fp32 reduction and master weights (default: on cuda)")  # fmt: skip
    add("--cuda-graph", action="store_true", help="run each step as one CUDA graph (cuda only)")
    add("--compile", action="store_true",
        help="trace the whole step once and compile it (fs.jit, inductor)")  # fmt: skip
    add("--recompute", action="store_true", help="recompute activations in the backward")
    add("--peak-tflops", type=float, default=989.0,
        help="peak TFLOP/s of one device for the MFU (default: 989, H100 dense bf16)")  # fmt: skip
    add("--ckpt-dir", default="", help="folder of the checkpoints (none when empty)")
    add("--save-every", type=int, default=0, help="save every this many steps (and at the end)")
    add("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    add("--stop-at", type=int, default=0, help="stop after this step (to try --resume)")
    add("--ranks", type=int, default=2, help="ranks to start outside torchrun (default: 2)")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a bad value is argparse's usage error (``SystemExit(2)``)."""
    p = parser()
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    wrong = [f"--{k.replace('_', '-')} {getattr(a, k)} must be at least 1"
             for k in ("width", "depth", "heads", "context", "batch", "steps", "ranks")
             if getattr(a, k) < 1]  # fmt: skip
    if a.width % a.heads or (a.width // a.heads) % 2:
        wrong.append(f"--heads {a.heads} must divide --width {a.width} into even head sizes")
    if not 0 <= a.warmup < a.steps:
        wrong.append(f"--warmup {a.warmup} must be in [0, --steps {a.steps})")
    if a.cuda_graph and a.device == "cpu":
        wrong.append(CPU_GRAPH)
    if (a.resume or a.save_every) and not a.ckpt_dir:
        wrong.append("--resume and --save-every need --ckpt-dir")
    if wrong:
        p.error("; ".join(wrong))
    return a


CPU_GRAPH = "--cuda-graph needs --device cuda (CUDA graphs do not exist on the CPU): drop it"


def launch(argv: list[str]) -> int:
    """Outside torchrun: check the flags, then start ``--ranks`` ranks of this script."""
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    options = ["--standalone", f"--nproc-per-node={args.ranks}"]
    try:
        torchrun.run(torchrun.parse_args([*options, os.path.abspath(__file__), *argv]))
    except ChildFailedError as e:  # the rank's error is above (a Refused one: one line)
        rank, failure = e.get_first_failure()
        print(f"train_llama.py: rank {rank} failed (exit code {failure.exitcode})",
              file=sys.stderr)  # fmt: skip
        return 2 if failure.exitcode == 2 else 1
    except SignalException as e:  # Ctrl-C: passed on to the ranks, which stop after a step
        return 128 + e.sigval
    return 0


if __name__ == "__main__" and "RANK" not in os.environ:
    sys.exit(launch(sys.argv[1:]))

import json  # noqa: E402 (the run: torch only now)
import signal  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from tqdm import tqdm  # noqa: E402

import funcshard as fs  # noqa: E402

from train_lm import Interrupt, Refused, batch_at, load_text, rows  # noqa: E402

# ----------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self) -> None:  # what fs.materialize calls to write the ones
        nn.init.ones_(self.weight)

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)


def rotary(x, cos, sin):
    """Rotate each pair (first half, second half) of ``x``'s last dim by its position's angle."""
    a, b = x.chunk(2, -1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, hidden = heads, 256 * ((8 * d // 3 + 255) // 256)  # SwiGLU width
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.wq, self.wk = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.wv, self.wo = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, t, self.heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))  # fmt: skip
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LlamaBlock(width, heads) for _ in range(depth))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        t, half = tokens.shape[1], self.embed.embedding_dim // self.heads // 2
        # the rotary angles: made here (a few kernels) rather than kept as buffers
        inv = 1e4 ** (-torch.arange(half, device=tokens.device, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(t, device=tokens.device, dtype=torch.float32), inv)
        h = self.embed(tokens)
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.head(self.norm(h))


def llama_init(depth: int):
    """For ``fs.materialize(init=...)``: N(0, 0.02) weights, the projections into the residual
    stream (``wo``, ``w2``) scaled down by ``sqrt(2 * depth)``; RMSNorm writes its own ones."""

    def init(name: str, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = name.endswith(("wo", "w2"))
            nn.init.normal_(module.weight, std=0.02 / (2 * depth) ** 0.5 if residual else 0.02)

    return init


def per_step(seconds: list[float], warmup: int = 3) -> float:
    """Mean seconds per step, without the first ``warmup`` steps while there are later ones:
    they compile (``--compile``), warm up and capture (``--cuda-graph``), or make NCCL's
    communicators, and would hide the speed of the steps that follow."""
    steady = seconds[warmup:] or seconds
    return sum(steady) / len(steady)


# ----------------------------------------------------------------------------- the run


def setup(a: argparse.Namespace) -> tuple[bool, str]:
    """Join torchrun's group (NCCL on CUDA, gloo on the CPU), unless one exists; the device."""
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.cuda_graph and device == "cpu":
        raise Refused(f"{CPU_GRAPH} (CUDA is not available here)")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_initialized():
        return False, device
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True, device


def main(argv: list[str] | None = None, interrupt: Interrupt | None = None) -> dict:
    """One rank of the run (under torchrun, or inside an existing group as the tests do).
    Returns ``{"losses": [mean training loss of each step run], "step": the last step,
    "interrupted": whether Ctrl-C stopped it, "parameters": the model's, "tokens_per_s": over
    all ranks, without the first three steps (this rank's clock)}``.

    Raises:
        SystemExit: a bad flag (argparse's usage error).
        Refused: ``--cuda-graph`` without CUDA; a ``--batch`` the ranks cannot share; a
            ``--ckpt-dir`` that does not fit ``--resume`` or the options.
    """
    a = parse(argv)
    created, device = setup(a)
    try:
        return train(a, device, interrupt or Interrupt())
    finally:
        if created:
            dist.destroy_process_group()


def train(a: argparse.Namespace, device: str, interrupt: Interrupt) -> dict:
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    rank, world = mesh.get_rank(), mesh.size()
    if a.batch % world:
        raise Refused(f"--batch {a.batch} is not divisible by the {world} ranks")
    bf16 = a.bf16 if a.bf16 is not None else device == "cuda"
    text = load_text(a.data_mb)
    with torch.device("meta"):
        model = Llama(len(text.vocab), a.width, a.depth, a.heads)
    example = torch.zeros(a.batch // world, a.context, dtype=torch.long, device="meta")
    plan = fs.plan(model, fs.policy.by_type(LlamaBlock), example_args=(example,),
                   recompute=a.recompute)  # fmt: skip
    dtypes = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}
    apply = fs.schedule(model, plan, **dtypes)
    # a warm-up from above 0: torch's capturable kernels divide by the learning rate. On CUDA
    # the fused kernel keeps the step counts on the device, so a CUDA graph's replays advance them
    lr = fs.optim.warmup_cosine_decay_schedule(a.lr / 100, a.lr, a.warmup, a.steps, a.lr / 10)
    cuda = device == "cuda"
    adamw = fs.optim.adamw(lr, betas=(0.9, 0.95), weight_decay=0.1, mask=fs.optim.at_least_2d,
                           fused=True if cuda else None)  # fmt: skip
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), adamw)

    torch.manual_seed(a.seed)
    params, _ = fs.materialize(model, mesh, init=llama_init(a.depth))
    state, step = opt.init(params), 0
    config = json.dumps({k: getattr(a, k) for k in ("width", "depth", "heads", "context",
                         "batch", "steps", "lr", "warmup", "seed", "data_mb")})  # fmt: skip
    if a.ckpt_dir:
        # rank 0's answer for all: ranks that saw the folder differently would part ways
        found = [fs.checkpoint.latest(a.ckpt_dir) if rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        newest = found[0]
        if newest and not a.resume:
            raise Refused(f"--ckpt-dir {a.ckpt_dir} holds a run ({newest}): add --resume to "
                          "continue it, or give another --ckpt-dir")  # fmt: skip
        if a.resume and newest is None:
            raise Refused(f"--resume: --ckpt-dir {a.ckpt_dir} holds no checkpoint")
        if a.resume:  # see train_lm.py's [Note: exact resume]; batches are a function of step
            theirs = fs.checkpoint.load(newest, {"config": ""}, strict=False)["config"]
            if theirs != config:
                raise Refused(f"{newest} was trained with {theirs}: resume with those "
                              "options, or give another --ckpt-dir")  # fmt: skip
            like = {"params": params, "opt": state, "step": 0, "config": ""}
            saved = fs.checkpoint.load(newest, like)
            params, state, step = saved["params"], saved["opt"], saved["step"]

    vg = fs.value_and_grad(
        lambda p, tokens: F.cross_entropy(
            apply(p, tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten()
        )
    )

    def train_step(params, state, tokens):
        loss, grads = vg(params, tokens)
        params, state = fs.optim.step(opt, params, grads, state)
        return loss, params, state

    run_step = fs.jit(train_step) if a.compile else train_step  # docs/compile.md
    if a.cuda_graph:
        run_step = fs.cuda_graph(run_step)

    n = sum(p.numel() for p in params.values())

    def throughput(tokens_per_s: float) -> tuple[str, str]:
        """tokens/s, and the model FLOPs utilisation: 6 FLOPs per parameter and token (forward
        and backward) over the peak of all ranks' devices ("-" on the CPU: no peak to compare)."""
        mfu = 6 * n * tokens_per_s / (a.peak_tflops * 1e12 * world)
        return f"{tokens_per_s:,.0f} tok/s", f"{mfu:.1%}" if cuda else "-"

    if rank == 0:
        resumed = f", resumed at step {step}" if step else ""
        tqdm.write(f"{n:,} parameters, {len(plan.groups)} groups, {world} ranks on {device}"
                   f"{', bf16' if bf16 else ''}{resumed}")  # fmt: skip
    bar = tqdm(total=a.steps, initial=step, disable=True if rank else None, desc="train")
    losses, seconds, stopped = [], [], False
    stop = min(a.steps, a.stop_at) if a.stop_at else a.steps
    while step < stop:
        tokens = rows(batch_at(text.train, step, a.batch, a.context, a.seed), rank, world)
        t0 = time.perf_counter()
        loss, params, state = run_step(params, state, tokens.to(device))
        both = torch.stack([loss.detach().float(), torch.tensor(float(interrupt.requested))
                            .to(device)])  # fmt: skip
        dist.all_reduce(both)  # the mean loss, and whether any rank got Ctrl-C
        mean, stopped = both[0].item() / world, both[1].item() > 0
        seconds.append(time.perf_counter() - t0)
        step += 1
        losses.append(mean)
        speed, mfu = throughput(a.batch * a.context / per_step(seconds))
        bar.set_postfix_str(f"loss {mean:.3f}, {speed}, MFU {mfu}")
        bar.update()
        due = step == a.steps or stopped or (a.save_every and step % a.save_every == 0)
        if a.ckpt_dir and due:
            tree = {"params": params, "opt": state, "step": step, "config": config}
            saved_at = fs.checkpoint.save(f"{a.ckpt_dir}/step_{step:06d}", tree, keep=2)
            if rank == 0:
                tqdm.write(f"saved {saved_at}")
        if stopped:
            break
    bar.close()
    if rank == 0 and losses:
        speed, mfu = throughput(a.batch * a.context / per_step(seconds))
        tqdm.write(f"{len(losses)} steps in {sum(seconds):.1f} s: loss {losses[0]:.3f} -> "
                   f"{losses[-1]:.3f}, {speed}, MFU {mfu}")  # fmt: skip
    if rank == 0 and stopped:
        saved = "; saved: continue with --resume" if a.ckpt_dir else " (no --ckpt-dir: not saved)"
        tqdm.write(f"stopped by Ctrl-C after step {step}{saved}")
    speed = a.batch * a.context / per_step(seconds) if seconds else 0.0
    return {"losses": losses, "step": step, "interrupted": stopped, "parameters": n,
            "tokens_per_s": speed}  # fmt: skip


if __name__ == "__main__":  # a rank under torchrun
    INTERRUPT = Interrupt()  # Ctrl-C: every rank stops after the same step (and saves it)
    signal.signal(signal.SIGINT, INTERRUPT.handle)
    try:
        sys.exit(128 + signal.SIGINT if main(interrupt=INTERRUPT)["interrupted"] else 0)
    except Refused as e:  # one message, from rank 0, not a traceback per rank
        if os.environ.get("RANK") == "0":
            print(f"train_llama.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
