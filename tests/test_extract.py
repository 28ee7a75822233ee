"""``extract`` and ``functional_call`` against ``named_parameters`` and ``torch.func``.

The reference for ``fs.functional_call`` is ``torch.func.functional_call`` on the intact module:
the same output, or the same exception with the same message. After ``module.to("meta")``
(which, in torch 2.13, gives each alias of a tied tensor its own meta tensor) funcshard should
still behave as torch does on the intact module, whenever the values given cover the module.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.func
from hypothesis import given, settings
from test_grouping import trees
from torch import nn

import funcshard as fs

from _models import TinyLM


class TiedBuffers(nn.Module):
    """A tied weight, a buffer registered at two paths, and a module at two paths."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.register_buffer("shift", torch.randn(3))
        self.b.register_buffer("shift", self.shift)
        self.norm = nn.LayerNorm(3)
        self.again = self.norm

    def forward(self, x):
        x = self.norm(self.a(x) + self.shift)
        return self.again(self.b(x) * self.b.shift)


def tiny_lm():
    torch.manual_seed(0)
    return TinyLM().eval()


def tied_buffers():
    torch.manual_seed(0)
    return TiedBuffers()


def lm_input():
    return torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(3))


def tb_input():
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(3))


MODELS = {"tinylm": (tiny_lm, lm_input), "tiedbuffers": (tied_buffers, tb_input)}
ALIASES = {"tinylm": ("head.weight", "embed.weight"), "tiedbuffers": ("b.weight", "a.weight")}
BUFFER_ALIASES = {"tinylm": {}, "tiedbuffers": {"b.shift": "shift"}}


# ---------------------------------------------------------------------------------------------
# extract


def _check_extract(model):
    params, buffers = fs.extract(model)
    named_p, named_b = list(model.named_parameters()), list(model.named_buffers())
    assert list(params) == [n for n, _ in named_p]
    assert list(buffers) == [n for n, _ in named_b]
    assert all(params[n] is p for n, p in named_p)  # the very objects: no copies
    assert all(buffers[n] is b for n, b in named_b)
    return params, buffers


def test_extract_order_identity_and_ties():
    params, buffers = _check_extract(tiny_lm())
    assert "embed.weight" in params and "head.weight" not in params
    assert list(buffers) == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    params, buffers = _check_extract(tied_buffers())
    assert list(params) == ["a.weight", "a.bias", "b.bias", "norm.weight", "norm.bias"]
    assert list(buffers) == ["shift"]


def test_extract_shares_storage_with_the_module():
    model = tiny_lm()
    params, _ = fs.extract(model)
    with torch.no_grad():
        params["embed.weight"][0, 0] = 123.0
    assert model.head.weight[0, 0] == 123.0


@settings(max_examples=60, deadline=None)
@given(module=trees())
def test_extract_random_trees(module):
    _check_extract(module)


# ---------------------------------------------------------------------------------------------
# functional_call on the intact module == torch.func.functional_call


def _outcome(fn, module, dicts, args, **kw):
    try:
        return ("ok", fn(module, dicts, args, **kw))
    except Exception as e:
        return ("err", type(e), str(e))


def _assert_same(got, want):
    assert got[0] == want[0], (got, want)
    if got[0] == "ok":
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    elif "which are tied" in want[2]:  # torch's text suggests tie_weights=False; ours the cause
        keys = want[2][want[2].index("[") : want[2].index("]") + 1]
        assert got[1] == want[1] and f"different tensors for {keys}" in got[2], (got, want)
    else:
        assert got[1:] == want[1:]


def _cases(name, params, buffers):
    """Named dict combinations: full, tied names given twice, missing and unexpected keys."""
    g = torch.Generator().manual_seed(1)
    new = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in params.items()}
    alias, first = ALIASES[name]
    w = new[first]
    no_first = {k: v for k, v in new.items() if k != first}
    some_key = next(k for k in new if k != first)
    return {
        "all": (new, buffers),
        "one dict": {**new, **buffers},
        "alias same tensor": ({**new, alias: w}, buffers),
        "alias equal copy": ({**new, alias: w.clone()}, buffers),
        "alias different": ({**new, alias: w + 1}, buffers),
        "alias only": ({**no_first, alias: w}, buffers),
        "params only": new,
        "missing one": ({k: v for k, v in new.items() if k != some_key}, buffers),
        "unexpected": ({**new, "bogus": w}, buffers),
        "first only": ({first: w}, buffers),
        "key in two dicts": (new, {**buffers, some_key: new[some_key]}),
    }


FLAGS = [{}, {"strict": True}, {"tie_weights": False}, {"tie_weights": False, "strict": True}]
CASES = [
    "all",
    "one dict",
    "alias same tensor",
    "alias equal copy",
    "alias different",
    "alias only",
    "params only",
    "missing one",
    "unexpected",
    "first only",
    "key in two dicts",
]


@pytest.mark.parametrize("flags", FLAGS, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("extracted", [False, True])
def test_functional_call_matches_torch(name, case, flags, extracted):
    make, inputs = MODELS[name]
    model = make()
    params, buffers = (fs.extract if extracted else _extract_plain)(model)
    dicts = _cases(name, params, buffers)[case]
    want = _outcome(torch.func.functional_call, model, dicts, (inputs(),), **flags)
    got = _outcome(fs.functional_call, model, dicts, (inputs(),), **flags)
    _assert_same(got, want)


def _extract_plain(model):
    return dict(model.named_parameters()), dict(model.named_buffers())


def test_args_as_in_torch():
    model = tied_buffers()
    params, buffers = fs.extract(model)
    x = tb_input()
    for args in (x, (x,)):
        got = fs.functional_call(model, (params, buffers), args)
        want = torch.func.functional_call(model, (params, buffers), args)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = fs.functional_call(model, params, kwargs={"x": x})
    torch.testing.assert_close(got, model(x), rtol=0, atol=0)


def test_tied_names_with_two_values_raise():
    model = tiny_lm()
    params, buffers = fs.extract(model)
    w = params["embed.weight"]
    with pytest.raises(ValueError, match="tied"):
        fs.functional_call(model, ({**params, "head.weight": w + 1}, buffers), (lm_input(),))


def test_tie_weights_false_keeps_the_modules_own_alias():
    model = tiny_lm()
    params, buffers = fs.extract(model)
    new = params["embed.weight"] + 1
    untied = fs.functional_call(
        model, ({"embed.weight": new}, buffers), (lm_input(),), tie_weights=False
    )
    head_kept = copy.deepcopy(model)
    head_kept.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    with torch.no_grad():
        head_kept.embed.weight.copy_(new)
    torch.testing.assert_close(untied, head_kept(lm_input()), rtol=0, atol=0)


def test_strict_is_torchs():
    model = tiny_lm()
    params, buffers = fs.extract(model)
    with pytest.raises(RuntimeError, match=r"Missing key.*bn\.running_mean"):
        fs.functional_call(model, params, (lm_input(),), strict=True)
    with pytest.raises(RuntimeError, match=r"Unexpected key.*bogus"):
        dicts = ({**params, "bogus": params["pos"]}, buffers)
        fs.functional_call(model, dicts, (lm_input(),), strict=True)
    # A tied name is covered by its first name, unless tie_weights=False.
    fs.functional_call(model, (params, buffers), (lm_input(),), strict=True)
    with pytest.raises(RuntimeError, match=r"Missing key.*head\.weight"):
        fs.functional_call(model, (params, buffers), (lm_input(),), strict=True, tie_weights=False)


def test_train_mode_updates_the_given_buffers_as_torch_does():
    model = tiny_lm().train()
    params, buffers = fs.extract(model)
    ours, theirs = (
        {k: v.clone() for k, v in buffers.items()},
        {k: v.clone() for k, v in buffers.items()},
    )
    got = fs.functional_call(model, (params, ours), (lm_input(),))
    want = torch.func.functional_call(model, (params, theirs), (lm_input(),))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.equal(ours["bn.running_mean"], buffers["bn.running_mean"])


# ---------------------------------------------------------------------------------------------
# After module.to("meta"): why extract remembers aliases.


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ties_survive_to_meta(name):
    make, inputs = MODELS[name]
    model = make()
    expected = model(inputs())
    params, buffers = fs.extract(model)
    model.to("meta")
    alias, first = ALIASES[name]
    assert model.get_parameter(alias) is not model.get_parameter(first)  # torch 2.13 unties
    got = fs.functional_call(model, (params, buffers), (inputs(),))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    got = fs.functional_call(model, (params, buffers), (inputs(),), strict=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # torch.func no longer knows the tie: the alias stays on meta.
    theirs = _outcome(torch.func.functional_call, model, (params, buffers), (inputs(),))
    assert theirs[0] == "err" or not torch.allclose(theirs[1], expected)
    with pytest.raises(RuntimeError, match=f"Missing key.*{re.escape(alias)}"):
        torch.func.functional_call(model, (params, buffers), (inputs(),), strict=True)


# Cases where the given values cover the module, so that its (now meta) storage is not read.
COVERING = [
    ("all", {}),
    ("all", {"strict": True}),
    ("all", {"tie_weights": False, "strict": True}),
    ("one dict", {}),
    ("alias same tensor", {}),
    ("alias same tensor", {"tie_weights": False}),
    ("alias equal copy", {"tie_weights": False}),
    ("alias different", {"tie_weights": False}),
    ("unexpected", {}),
    ("unexpected", {"strict": True}),
    ("missing one", {"strict": True}),
    ("params only", {"strict": True}),
]


@pytest.mark.parametrize(("case", "flags"), COVERING, ids=str)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_after_meta_behaves_like_torch_on_the_intact_module(name, case, flags):
    make, inputs = MODELS[name]
    model = make()
    intact = copy.deepcopy(model)
    params, buffers = fs.extract(model)
    model.to("meta")
    dicts = _cases(name, params, buffers)[case]
    if flags.get("tie_weights") is False:  # the tied buffer's alias must be given too
        more = {a: buffers[f] for a, f in BUFFER_ALIASES[name].items()}
        dicts = (*((dicts,) if isinstance(dicts, dict) else dicts), more)
    want = _outcome(torch.func.functional_call, intact, dicts, (inputs(),), **flags)
    got = _outcome(fs.functional_call, model, dicts, (inputs(),), **flags)
    _assert_same(got, want)


@pytest.mark.parametrize("case", ["alias different", "alias equal copy"])
def test_after_meta_two_values_for_tied_names_raise(case):
    model = tiny_lm()
    intact = copy.deepcopy(model)
    params, buffers = fs.extract(model)
    model.to("meta")
    dicts = _cases("tinylm", params, buffers)[case]
    want = _outcome(torch.func.functional_call, intact, dicts, (lm_input(),))
    assert want[:2] == ("err", ValueError)
    _assert_same(_outcome(fs.functional_call, model, dicts, (lm_input(),)), want)


def test_after_meta_value_under_alias_name_only():
    model = tiny_lm()
    intact = copy.deepcopy(model)
    params, buffers = fs.extract(model)
    model.to("meta")
    dicts = _cases("tinylm", params, buffers)["alias only"]
    want = _outcome(torch.func.functional_call, intact, dicts, (lm_input(),))
    assert want[0] == "ok"
    _assert_same(_outcome(fs.functional_call, model, dicts, (lm_input(),)), want)
