"""``python -m funcshard.explain``: a model's step at scale, without the machines.

The model is built on the meta device, sharded over a fake world (``_fake_world``) and its
step explained on fake tensors (``fs.explain``); the largest batch within a budget comes from a
few more explains (``_explain_scale``). The usage is ``funcshard/explain.py``'s docstring.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._plans._grouping import Policy, any_of, by_names, by_type
from . import _explain
from ._explain import _size
from ._explain_scale import largest_batch, parse_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- the model -----------------------------------------------------------------------------
def model_from_factory(spec: str) -> nn.Module:
    """``"package.module:function"`` called with no arguments under ``torch.device("meta")``.

    Raises:
        ValueError: ``spec`` is not ``module:function`` (or does not import), or the function
            returns no module.
    """
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise ValueError(f"--model {spec!r}: expected module:function, e.g. mypkg.models:llama")
    try:
        factory = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"--model {spec!r}: expected module:function, e.g. mypkg.models:llama, importable "
            f"from PYTHONPATH ({err})"
        ) from err
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def hf_config(spec: str, overrides: dict[str, Any]) -> Any:
    """A transformers config: a JSON object (``{"model_type": "llama", ...}``), a local
    ``config.json`` or folder, a model type (``llama``: its defaults), or a hub name; then
    ``overrides`` set on it."""
    from pathlib import Path

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = spec.strip()
    if text.startswith("{"):
        fields = json.loads(text)
    elif Path(text).is_file():
        fields = json.loads(Path(text).read_text())
    else:
        fields = None
    if fields is not None:
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"--hf-config {spec!r}: the JSON needs a model_type (e.g. llama)")
        return AutoConfig.for_model(model_type, **{**fields, **overrides})
    if text in CONFIG_MAPPING:
        return AutoConfig.for_model(text, **overrides)
    return AutoConfig.from_pretrained(text, **overrides)


def parse_overrides(text: str | None) -> dict[str, Any]:
    """``"hidden_size=4096,tie_word_embeddings=false"`` -> ``{"hidden_size": 4096, ...}``
    (values read as JSON when they parse, else strings)."""
    out: dict[str, Any] = {}
    for item in filter(None, (text or "").split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--hf-override: {item!r} is not key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def model_from_hf(config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# ---- the groups ----------------------------------------------------------------------------
def default_policy(model: nn.Module) -> tuple[Policy, list[str]]:
    """A group per repeated block (the class of the children of a ``ModuleList`` /
    ``Sequential`` of one class, two or more), one per embedding outside them, and one for the
    head (a ``Linear`` outside the blocks onto an embedding's vocabulary, not tied to it).
    Returns the policy and a description."""
    blocks: set[type[nn.Module]] = set()
    for m in model.modules():
        kids = list(m.children()) if isinstance(m, nn.ModuleList | nn.Sequential) else []
        if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and list(kids[0].parameters()):
            blocks.add(type(kids[0]))
    inside = {n for n, m in model.named_modules() if isinstance(m, tuple(blocks))}

    def outside(name: str) -> bool:
        return not any(name == b or name.startswith(b + ".") for b in inside)

    embeds = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding) and outside(n)}
    vocab = {m.num_embeddings: m.weight for m in embeds.values()}
    heads = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and outside(n)
        and m.out_features in vocab
        and m.weight is not vocab[m.out_features]
    ]
    names = sorted(embeds) + heads
    chosen = [by_type(*sorted(blocks, key=lambda c: c.__name__))] if blocks else []
    described = [c.__name__ for c in sorted(blocks, key=lambda c: c.__name__)] + names
    return any_of(*chosen, by_names(names)), described


def named_policy(model: nn.Module, items: Sequence[str]) -> Policy:
    """``--policy A,B``: each a module class name in the model or a module's name.

    Raises:
        ValueError: an item names neither.
    """
    classes = {type(m).__name__: type(m) for m in model.modules()}
    modules = {n for n, _ in model.named_modules()}
    unknown = [i for i in items if i not in classes and i not in modules]
    if unknown:
        raise ValueError(
            f"--policy: {unknown} name neither a module class of the model nor a module; "
            f"classes: {sorted(classes)}"
        )
    types = [classes[i] for i in items if i in classes]
    return any_of(by_type(*types), by_names([i for i in items if i not in classes]))


# ---- the step ------------------------------------------------------------------------------
def token_loss(out: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (``out.logits`` or ``out``) in float32, as a trainer takes it
    (the float32 logits can set the peak)."""
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.flatten(0, -2).float(), tokens.flatten())


def step_explainer(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    seq: int,
    group_policy: Policy,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    recompute: bool = False,
    reshard_after_forward: bool | int = True,
    optimizer: str = "adamw",
    hardware: _explain.Hardware | None = None,
    input_width: int | None = None,
) -> Callable[[int], _explain.Explanation]:
    """``batch -> fs.explain`` of one step of ``model`` (on meta) sharded over ``mesh`` (call
    it inside ``fake_world``); inputs: token ids ``(batch, seq)`` with the token loss, or, with
    ``input_width``, floats ``(batch, seq, input_width)`` with the sum of the output."""
    from .. import optim
    from .._execution._schedule import schedule
    from .._plans._plan import plan
    from .._trees._extract import extract
    from ..transforms import shard

    params, buffers = extract(model)

    def inputs(batch: int) -> torch.Tensor:
        if input_width is None:
            return torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return torch.zeros(batch, seq, input_width, device="meta")

    options = dict(
        reshard_after_forward=reshard_after_forward,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        recompute=True if recompute else None,
    )
    try:
        the_plan = plan(model, group_policy, example_args=(inputs(1),), **options)
    except RuntimeError as e:  # a forward that cannot run on meta tensors: module order
        print(f"note: {e}\n      using the module order instead (groups used out of it are "
              "gathered on demand, with a warning)")  # fmt: skip
        the_plan = plan(model, group_policy, **options)
    apply = schedule(model, the_plan)
    sharded = shard(params, mesh)
    opt = optim.adamw(1e-4) if optimizer == "adamw" else None
    loss = token_loss if input_width is None else None
    hw = hardware or _explain.Hardware.h100()

    def make(batch: int) -> _explain.Explanation:
        x = inputs(batch)
        return _explain.explain(
            apply, sharded, x, optimizer=opt, buffers=buffers, loss=loss, hardware=hw
        )

    return make


def mesh_shape(text: str) -> tuple[int, ...]:
    """``"64"`` -> ``(64,)``; ``"8x128"`` -> ``(8, 128)`` (HSDP: replicate x shard)."""
    try:
        shape = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1 or len(shape) > 2:
        raise ValueError(f"--world {text!r}: expected N or RxS (HSDP), e.g. 64 or 8x128")
    return shape


# ---- the command ---------------------------------------------------------------------------
def parser(usage: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m funcshard.explain",
        description=usage,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="module:function returning an nn.Module (built on meta)")
    src.add_argument("--hf-config", help="transformers config: model type, JSON, file or name")
    ap.add_argument("--hf-override", help="config fields, k=v,k=v (values as JSON)")
    ap.add_argument("--world", default="8", help="ranks, or RxS for HSDP (default 8)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank (default 1)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--input-width", type=int, help="float inputs (batch, seq, W), not tokens")
    ap.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--policy", help="comma-separated block classes or module names")
    ap.add_argument("--recompute", action="store_true", help="recompute every block in backward")
    reshard = ap.add_mutually_exclusive_group()
    reshard.add_argument(
        "--no-reshard", action="store_true", help="keep gathered params to backward"
    )
    reshard.add_argument(
        "--reshard-to", type=int, metavar="N", help="after forward keep a 1/N slice (hpZ)"
    )
    ap.add_argument("--optimizer", choices=("adamw", "none"), default="adamw")
    ap.add_argument("--budget", default="80GB", help="bytes per rank: 80GB (1e9) or 80GiB")
    ap.add_argument("--hardware", choices=("h100", "measure"), default="h100")
    ap.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    ap.add_argument("--json", help="write the explanation and the answers as JSON")
    ap.add_argument("--png", help="write Explanation.plot's figure")
    return ap


def main(argv: Sequence[str] | None = None, usage: str = "") -> int:
    ap = parser(usage)
    args = ap.parse_args(argv)
    try:
        shape = mesh_shape(args.world)
        budget = parse_bytes(args.budget)
        if args.model:
            model = model_from_factory(args.model)
        else:
            model = model_from_hf(hf_config(args.hf_config, parse_overrides(args.hf_override)))
        if args.policy:
            group_policy, described = named_policy(model, args.policy.split(",")), args.policy
        else:
            group_policy, names = default_policy(model)
            described = ", ".join(names) or "(the root only)"
    except ValueError as e:
        ap.error(str(e))
    print(f"groups: {described}; world {' x '.join(map(str, shape))} (fake)")
    hardware = _explain.Hardware.h100() if args.hardware == "h100" else _explain.Hardware.measure()
    from ._fake_world import fake_world

    with fake_world(shape) as mesh:
        make = step_explainer(
            model,
            mesh,
            seq=args.seq,
            group_policy=group_policy,
            param_dtype=DTYPES[args.param_dtype],
            reduce_dtype=DTYPES[args.reduce_dtype],
            recompute=args.recompute,
            reshard_after_forward=args.reshard_to or not args.no_reshard,
            optimizer=args.optimizer,
            hardware=hardware,
            input_width=args.input_width,
        )
        runs: dict[int, tuple[_explain.Explanation, float]] = {}

        def timed(b: int) -> _explain.Explanation:
            if b not in runs:
                t0 = time.perf_counter()
                runs[b] = make(b), time.perf_counter() - t0
            return runs[b][0]

        e = timed(args.batch)
        print(e)
        fits = e.fits(budget)
        print(
            f"fits in {args.budget} per rank at batch {args.batch}: {'yes' if fits else 'no'} "
            f"(peak {_size(e.peak_bytes)} = {e.peak_bytes / 1e9:.3g} GB; "
            f"explain {runs[args.batch][1]:.1f} s)"
        )
        best = None
        if not args.no_search:
            best = largest_batch(timed, budget)
            tried = ", ".join(f"{b}: {_size(r[0].peak_bytes)}" for b, r in sorted(runs.items()))
            spent = sum(r[1] for r in runs.values())
            print(
                f"largest batch that fits: {best} (peak by batch tried: {tried}; "
                f"{len(runs)} explains, {spent:.1f} s)"
            )
    if args.json:
        out = json.loads(e.to_json())
        out["answers"] = {
            "budget_bytes": budget,
            "batch": args.batch,
            "fits": fits,
            "largest_batch": best,
            "peak_bytes_by_batch": {b: r[0].peak_bytes for b, r in sorted(runs.items())},
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.png:
        try:
            e.plot(args.png)
        except (AttributeError, ImportError) as err:
            print(f"--png skipped: Explanation.plot is not available ({err})")
    return 0 if math.isfinite(e.peak_bytes) else 1
