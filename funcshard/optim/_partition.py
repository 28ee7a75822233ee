"""One transformation per group of parameters (optax's ``partition``), and the Muon + AdamW
recipe built with it."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from .._trees._tree import PyTree, flatten, unflatten
from ._adam_sgd import LearningRate, adamw
from ._base import GradientTransformation, leaves_like
from ._masked import Mask, keep
from ._muon import muon

Labels = Callable[[str, torch.Tensor], str | None] | PyTree  # a function, or a tree of labels


class PartitionState(NamedTuple):
    """State of :func:`partition`: ``inner``, ``{label: that transformation's state}``."""

    inner: dict[str, Any]


def partition(transforms: Mapping[str, GradientTransformation], labels: Labels):
    """Each parameter updated by the transformation of its label, as ``optax.partition``.

    Every transformation sees ``None`` in place of the other parameters (it keeps no state for
    them), as with :func:`masked`; the updates are merged leaf by leaf. In the donated form
    (:func:`step`) each group is stepped in place by its own transformation. Example: Muon for
    the hidden matrices and AdamW for the rest, each with its own learning rate, is
    ``partition({"muon": muon(0.02), "adamw": adamw(3e-4)}, lambda path, p: ...)``
    (:func:`muon_adamw` is that recipe).

    Args:
        transforms: ``{label: transformation}``.
        labels: ``fn(path, param) -> label``, or a tree of labels with the parameters' structure.

    Raises:
        ValueError (from ``init``/``update``): a parameter whose label is ``None`` or is not a key
            of ``transforms``, naming it; the state is not this partition's.
    """
    transforms = dict(transforms)
    for label, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"partition: transforms[{label!r}] is a {type(t).__name__}, not a "
                "GradientTransformation."
            )

    def init(params):
        picked = _labelled(transforms, labels, params)
        return PartitionState({k: t.init(keep(params, picked[k])) for k, t in transforms.items()})

    def run(grads, state, params, inplace: bool):
        if not isinstance(state, PartitionState) or set(state.inner) != set(transforms):
            raise ValueError(
                f"partition: the state is not the PartitionState of labels {sorted(transforms)} "
                "that this partition's init returned."
            )
        picked = _labelled(transforms, labels, grads if params is None else params)
        _, merged, spec = flatten(grads, none_is_leaf=True)
        new = {}
        for k, t in transforms.items():
            update = (t.update_inplace or t.update) if inplace else t.update
            sub_params = None if params is None else keep(params, picked[k])
            sub, new[k] = update(keep(grads, picked[k]), state.inner[k], sub_params)
            us = leaves_like(sub, grads, "updates", "grads")
            merged = [u if p else m for m, u, p in zip(merged, us, picked[k], strict=True)]
        return unflatten(spec, merged), PartitionState(new)

    return GradientTransformation(
        init,
        lambda grads, state, params=None: run(grads, state, params, False),
        lambda grads, state, params=None: run(grads, state, params, True),
    )


def _labelled(transforms: dict, labels: Labels, tree: PyTree) -> dict[str, list[bool]]:
    """``{label: [leaf has it]}``; every tensor leaf has exactly one known label."""
    paths, leaves, _ = flatten(tree, none_is_leaf=True)
    if callable(labels):
        given = [None if x is None else labels(p, x) for p, x in zip(paths, leaves, strict=True)]
    else:
        given = leaves_like(labels, tree, "labels", "params")
    for path, x, label in zip(paths, leaves, given, strict=True):
        if x is not None and label not in transforms:
            raise ValueError(
                f"partition: {path!r} has label {label!r}, which has no transformation (the "
                f"labels are {sorted(transforms)}): every parameter needs one. Give it a label "
                "of transforms (a frozen parameter can take any, with a None gradient), or add "
                "a transformation for that label."
            )
    return {
        k: [x is not None and g == k for x, g in zip(leaves, given, strict=True)]
        for k in transforms
    }


_EMBED_OR_HEAD = re.compile(
    r"(^|\.)(embed|embeds|embedding|embeddings|embed_tokens|tok_embeddings|word_embeddings|"
    r"position_embeddings|wte|wpe|lm_head|head|output)\.[^.]+$"
)


def hidden_matrices(path: str, param: torch.Tensor) -> bool:
    """The default Muon predicate of :func:`muon_adamw`: 2-D parameters that are not the
    embedding or the output head by name (the module holding the weight is called ``embed``,
    ``embed_tokens``, ``tok_embeddings``, ``wte``, ``wpe``, ``*_embeddings``, ``lm_head``,
    ``head`` or ``output``). Embeddings named otherwise need a predicate of your own."""
    return param.dim() == 2 and not _EMBED_OR_HEAD.search(path)


def muon_adamw(
    lr: LearningRate,
    adamw_lr: LearningRate,
    *,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 0.01,
    adamw_mask: Mask | None = None,
    is_muon: Callable[[str, torch.Tensor], bool] = hidden_matrices,
    stacked: Mask | None = None,
) -> GradientTransformation:
    """The standard Muon recipe: :func:`muon` for the hidden matrices, :func:`adamw` for the
    embeddings, the head, norms and biases, as ``torch.optim.Muon`` + ``torch.optim.AdamW`` on
    two parameter lists.

    A :func:`partition` with labels ``"muon"`` (where ``is_muon(path, param)``) and ``"adamw"``;
    its state is a :class:`PartitionState` with those two keys. Chain it after
    :func:`clip_by_global_norm`; ``lr`` and ``adamw_lr`` may be schedules.

    Args:
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn,
            stacked: :func:`muon`'s.
        adamw_lr, betas, adamw_eps, adamw_weight_decay, adamw_mask: :func:`adamw`'s ``lr``,
            ``betas``, ``eps``, ``weight_decay`` and ``mask``.
        is_muon: which parameters Muon updates; default :func:`hidden_matrices`.

    Raises:
        ValueError: as :func:`muon` and :func:`adamw`; a parameter ``is_muon`` selects that is
            not 2-D (nor a 3-D ``stacked`` one), naming it.
    """
    hidden = muon(
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn,
        stacked=stacked,
    )  # fmt: skip
    rest = adamw(adamw_lr, betas, adamw_eps, adamw_weight_decay, mask=adamw_mask)
    return partition(
        {"muon": hidden, "adamw": rest},
        lambda path, p: "muon" if is_muon(path, p) else "adamw",
    )
