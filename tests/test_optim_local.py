"""fs.optim in one process, on plain tensors: torch.optim parity on nested trees with frozen and
integer leaves, schedules against torch's LR schedulers, purity of ``update``, and errors."""

from __future__ import annotations

import math
from unittest import mock

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard._runtime import _mode

optim = fs.optim


def _tree(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "layer": [torch.randn(4, 3, generator=g), torch.randn(4, generator=g)],
        "frozen": torch.randn(2, generator=g),
        "ids": torch.arange(3),  # integer: never gets a gradient, gets no state
    }


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {
        "layer": [torch.randn(4, 3, generator=g), torch.randn(4, generator=g)],
        "frozen": None,
        "ids": None,
    }


def _clone(tree):
    return torch.utils._pytree.tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, tree)


@pytest.mark.parametrize("donated", [True, False])
def test_plain_tensors_nested_tree_with_frozen_leaves(donated):
    params = _tree()
    trained = [t.clone().requires_grad_() for t in params["layer"]]
    topt = torch.optim.AdamW(
        [{"params": trained[:1]}, {"params": trained[1:], "weight_decay": 0.0}],
        lr=0.05,
        weight_decay=0.1,
    )
    opt = optim.adamw(0.05, weight_decay=0.1, mask=optim.at_least_2d)
    state = opt.init(params)
    assert state.mu["ids"] is None and state.mu["frozen"].shape == (2,)
    frozen = params["frozen"].clone()
    for step in range(3):
        grads = _grads(step)
        for t, g in zip(trained, grads["layer"], strict=True):
            t.grad = g.clone()
        topt.step()
        if donated:
            params, state = optim.step(opt, params, grads, state)
        else:
            updates, state = opt.update(grads, state, params)
            assert updates["frozen"] is None and updates["ids"] is None
            params = optim.apply_updates(params, updates)
    for ours, theirs in zip(params["layer"], trained, strict=True):
        torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=0 if donated else 1e-7)
    assert torch.equal(params["frozen"], frozen) and torch.equal(params["ids"], torch.arange(3))
    assert torch.equal(state.mu["frozen"], torch.zeros(2)) and int(state.count) == 3


def _torch_lrs(make_scheduler, steps):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
    sched = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


LR = torch.optim.lr_scheduler


@pytest.mark.parametrize(
    ("ours", "theirs", "steps"),
    [
        (optim.constant_schedule(0.2), lambda o: LR.ConstantLR(o, factor=1.0), 5),
        (optim.linear_schedule(0.02, 0.2, 5), lambda o: LR.LinearLR(o, 0.1, 1.0, 5), 9),
        (
            optim.cosine_decay_schedule(0.2, 10, alpha=0.1),
            lambda o: LR.CosineAnnealingLR(o, 10, 0.02),
            11,
        ),
        (
            optim.warmup_cosine_decay_schedule(0.02, 0.2, 5, 15, end_value=0.02),
            lambda o: LR.SequentialLR(
                o, [LR.LinearLR(o, 0.1, 1.0, 5), LR.CosineAnnealingLR(o, 10, 0.02)], [5]
            ),
            16,
        ),
    ],
    ids=["constant", "linear", "cosine", "warmup_cosine"],
)
def test_schedules_match_torch_lr_schedulers(ours, theirs, steps):
    expected = _torch_lrs(theirs, steps)
    assert [ours(t) for t in range(steps)] == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_schedule_is_evaluated_at_the_state_count():
    seen = []
    opt = optim.sgd(lambda t: seen.append(t) or 0.1)
    params = {"w": torch.ones(2)}
    state = opt.init(params)
    for _ in range(3):
        params, state = optim.step(opt, params, {"w": torch.ones(2)}, state)
    assert seen == [0, 1, 2]
    torch.testing.assert_close(params["w"], torch.full((2,), 0.7))
    assert "WarmupCosineDecay(init_value=0.0" in repr(
        optim.warmup_cosine_decay_schedule(0, 1, 1, 2)
    )


_VALUES = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)
_STEPS = st.integers(0, 200)


@st.composite
def _schedules(draw):
    kind = draw(st.sampled_from(["constant", "linear", "cosine", "warmup_cosine"]))
    if kind == "constant":
        return optim.constant_schedule(draw(_VALUES))
    if kind == "linear":
        return optim.linear_schedule(draw(_VALUES), draw(_VALUES), draw(_STEPS), draw(_STEPS))
    if kind == "cosine":
        return optim.cosine_decay_schedule(draw(_VALUES), draw(st.integers(1, 200)), draw(_VALUES))
    warmup = draw(_STEPS)
    decay = draw(st.integers(warmup + 1, warmup + 200))
    return optim.warmup_cosine_decay_schedule(
        draw(_VALUES), draw(_VALUES), warmup, decay, draw(_VALUES)
    )


@settings(max_examples=300, deadline=None)
@given(schedule=_schedules(), step=st.integers(0, 500))
def test_schedules_of_a_tensor_count_agree_with_an_int_count(schedule, step):
    """The torch-ops path (a compiled step's) gives the float path's value as a 0-dim float64
    tensor; the int path still returns a float. (Both give NaN where the arithmetic does, e.g.
    a denormal peak with end_value > 0: the optimizer refuses a non-finite rate eagerly.)"""
    expected = schedule(step)
    assert type(expected) is float
    for count in (torch.tensor(step), torch.tensor([step])):  # int64, as the state's count
        value = schedule(count)
        assert (
            isinstance(value, torch.Tensor) and value.shape == () and value.dtype.is_floating_point
        )
        assert value.item() == pytest.approx(expected, rel=1e-7, abs=1e-12, nan_ok=True), count


def test_schedules_trace_without_python_numbers():
    """Schedules of a fake count (as AOTAutograd traces them) record torch ops, with no .item()
    (which a fake tensor refuses)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        count = mode.from_tensor(torch.tensor(3))
        for schedule in (
            optim.constant_schedule(0.1),
            optim.linear_schedule(0.0, 1.0, 4, 2),
            optim.linear_schedule(0.5, 1.0, 0),
            optim.cosine_decay_schedule(1.0, 10, 0.1),
            optim.warmup_cosine_decay_schedule(0.0, 1.0, 4, 12, 0.1),
        ):
            assert schedule(count).shape == (), schedule


def test_a_traced_count_is_given_to_the_schedule():
    """With the count traced (faked here by patching ``compiling``; SGD's foreach kernel takes a
    tensor lr eagerly too): a schedule's tensor lr gives the float lr's update; a schedule that
    returns a number is checked; one that returns several numbers is refused."""

    def one_step(opt):
        params = {"w": torch.ones(3)}
        return optim.step(opt, params, {"w": torch.ones(3)}, opt.init(params))[0]

    expected = one_step(optim.sgd(0.5, momentum=0.9))
    with mock.patch("funcshard.optim._adam_sgd.compiling", return_value=True):
        torch.testing.assert_close(
            one_step(optim.sgd(optim.linear_schedule(0.5, 0.0, 4), momentum=0.9)), expected
        )
        with pytest.raises(ValueError, match=r"learning rate at a compiled step is -1\.0"):
            one_step(optim.sgd(lambda t: -1.0))
        with pytest.raises(TypeError, match=r"sgd: the learning-rate schedule .* shape \[2\]"):
            one_step(optim.sgd(lambda t: torch.ones(2)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.chain(
            optim.clip_by_global_norm(0.1), optim.adamw(0.1, mask=optim.at_least_2d)
        ),
        lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, foreach=True),
        lambda: optim.sgd(0.1, momentum=0.9, dampening=0.5, weight_decay=0.1),
        lambda: optim.chain(
            optim.masked(optim.add_decayed_weights(0.1), optim.at_least_2d), optim.adam(0.1)
        ),
    ],
    ids=["clip+adamw", "nesterov foreach", "dampening", "masked decay+adam"],
)
def test_update_does_not_modify_its_inputs(make):
    opt = make()
    params = _tree()
    state = opt.init(params)
    for step in range(2):
        grads = _grads(step)
        before = _clone((params, grads, state))
        updates, new_state = opt.update(grads, state, params)
        after = (params, grads, state)
        flat = optree.tree_leaves  # None entries are not leaves
        assert all(torch.equal(a, b) for a, b in zip(flat(before), flat(after), strict=True))
        params, state = optim.apply_updates(params, updates), new_state


def test_apply_updates():
    params = {"a": torch.ones(2, requires_grad=True), "b": torch.ones(1, dtype=torch.bfloat16)}
    updates = {"a": torch.full((2,), 0.5), "b": None}
    new = optim.apply_updates(params, updates)
    assert new["a"] is not params["a"] and new["a"].requires_grad and new["a"].is_leaf
    assert torch.equal(new["a"], torch.full((2,), 1.5)) and new["b"] is params["b"]
    assert torch.equal(params["a"], torch.ones(2))
    same = optim.apply_updates(params, {"a": None, "b": torch.ones(1)}, inplace=True)
    assert same is params and params["b"].dtype == torch.bfloat16 and params["b"].item() == 2


def test_updates_and_state_are_not_part_of_a_graph():
    params = {"w": torch.ones(3, requires_grad=True)}
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.1))
    updates, state = opt.update({"w": torch.ones(3)}, opt.init(params), params)
    assert updates["w"].grad_fn is None and not updates["w"].requires_grad
    assert not state[1].mu["w"].requires_grad and optim.global_norm(params).grad_fn is None


def test_sgd_without_momentum_keeps_no_buffers():
    state = optim.sgd(0.1).init({"w": torch.ones(3)})
    assert isinstance(state, optim.SgdState) and state.momentum is None


# --- errors --------------------------------------------------------------------------------------


def _setup(opt):
    params = {"a": torch.ones(3), "b": torch.ones(2, 2), "ids": torch.arange(2)}
    return opt, params, opt.init(params)


def test_errors_name_the_key_and_the_fix():
    opt, params, state = _setup(optim.adamw(0.1))
    with pytest.raises(ValueError, match="missing from grads: 'b'"):
        opt.update({"a": torch.ones(3), "ids": None}, state, params)
    with pytest.raises(ValueError, match=r"grads\['b'\] has shape and placements \[4\]"):
        opt.update({"a": torch.ones(3), "b": torch.ones(4), "ids": None}, state, params)
    with pytest.raises(ValueError, match=r"grads\['ids'\] is a gradient, but the optimizer state"):
        opt.update({"a": None, "b": None, "ids": torch.ones(2)}, state, params)
    with pytest.raises(ValueError, match="needs params"):
        opt.update({"a": None, "b": None, "ids": None}, state)
    with pytest.raises(TypeError, match="SgdState, not the AdamState"):
        opt.update({"a": None, "b": None, "ids": None}, optim.sgd(0.1).init(params), params)
    with pytest.raises(ValueError, match=r"missing from adamw state\.mu: 'a'"):
        opt.update({"a": None, "b": None, "ids": None}, opt.init({"b": params["b"]}), params)
    other = opt.init({"a": torch.ones(5), "b": params["b"], "ids": params["ids"]})
    with pytest.raises(ValueError, match=r"state\.mu\['a'\] has shape and placements \[5\]"):
        opt.update({"a": torch.ones(3), "b": None, "ids": None}, other, params)
    chained = optim.chain(optim.clip_by_global_norm(1.0), opt)
    with pytest.raises(ValueError, match="tuple of 2 states"):
        chained.update(params, state, params)
    with pytest.raises(TypeError, match="argument 1 is a WarmupCosineDecay"):
        optim.chain(opt, optim.warmup_cosine_decay_schedule(0, 1, 1, 2))


def test_errors_in_hyperparameters_and_schedules():
    with pytest.raises(ValueError, match=r"adamw: lr=-0.1 is invalid"):
        optim.adamw(-0.1)
    with pytest.raises(ValueError, match=r"betas\[1\]=1.0 is invalid; it must be in \[0, 1\)"):
        optim.adam(0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="max_norm=0"):
        optim.clip_by_global_norm(0)
    with pytest.raises(ValueError, match="decay_steps=5 must be greater than warmup_steps=5"):
        optim.warmup_cosine_decay_schedule(0, 1, 5, 5)
    with pytest.raises(ValueError, match="peak_value=-1"):
        optim.warmup_cosine_decay_schedule(0, -1, 5, 10)
    opt, params, state = _setup(optim.sgd(lambda t: 0.1 if t < 2 else -0.5))
    grads = {"a": torch.ones(3), "b": None, "ids": None}
    for _ in range(2):
        params, state = optim.step(opt, params, grads, state)
    with pytest.raises(ValueError, match=r"learning rate at step 2 is -0\.5"):
        optim.step(opt, params, grads, state)


def test_errors_of_masks_chains_and_apply_updates():
    bad = optim.adamw(0.1, mask={"a": 1, "b": True, "ids": False})
    opt, params, state = _setup(bad)
    with pytest.raises(TypeError, match="the mask's entry for 'a' is a int"):
        opt.update({"a": torch.ones(3), "b": None, "ids": None}, state, params)
    opt, params, state = _setup(optim.chain(optim.adamw(0.1), optim.clip_by_global_norm(1.0)))
    with pytest.raises(ValueError, match="transformation 0 of 2 applied its update"):
        optim.step(opt, params, {"a": torch.ones(3), "b": None, "ids": None}, state)
    with pytest.raises(TypeError, match=r"updates\['x'\] has no parameter"):
        optim.apply_updates({"x": None}, {"x": torch.ones(1)})
    with pytest.raises(TypeError, match="MaskedState"):
        optim.masked(optim.adam(0.1), optim.at_least_2d).update({}, (), {})


def test_step_falls_back_to_update_for_user_transformations():
    # an optax-style transformation with only init and update
    scale = optim.GradientTransformation(
        lambda p: optim.EmptyState(), lambda g, s, p=None: ({k: -0.5 * v for k, v in g.items()}, s)
    )
    params, _ = optim.step(scale, {"w": torch.ones(2)}, {"w": torch.ones(2)}, optim.EmptyState())
    assert torch.equal(params["w"], torch.full((2,), 0.5))
    assert math.isclose(optim.global_norm({"a": torch.full((4,), 2.0), "b": None}).item(), 4.0)


@pytest.mark.parametrize("donated", [True, False])
@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW])
def test_a_leaf_frozen_for_a_while_gets_torch_optims_bias_correction(make, donated):
    # "late" has no gradient for its first 6 steps, "gap" none for steps 2..7: torch.optim counts
    # steps per parameter, so their bias corrections restart where they stopped
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(3, 2, generator=g), "late": torch.randn(4, generator=g)}
    params["gap"] = torch.randn(2, generator=g)
    theirs = {k: v.clone().requires_grad_() for k, v in params.items()}
    topt = make(theirs.values(), lr=0.05, weight_decay=0.1)
    ours = fs.optim.adamw if make is torch.optim.AdamW else fs.optim.adam
    opt = ours(0.05, weight_decay=0.1)
    state = opt.init(params)
    for step in range(12):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        grads["late"] = None if step < 6 else grads["late"]
        grads["gap"] = None if 2 <= step < 8 else grads["gap"]
        for k, t in theirs.items():
            t.grad = None if grads[k] is None else grads[k].clone()
        topt.step()
        if donated:
            params, state = optim.step(opt, params, grads, state)
        else:
            updates, state = opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
    for k, t in theirs.items():
        torch.testing.assert_close(params[k], t.detach(), rtol=0, atol=0 if donated else 1e-7)
        assert torch.equal(state.steps[k], topt.state[t]["step"]), k
    assert [int(state.steps[k]) for k in ("w", "late", "gap")] == [12, 6, 6]
    assert int(state.count) == 12  # the schedule's step counts every update


def test_low_precision_scalars_and_learning_rates_as_torch_optim_takes_them():
    # a 0-dim bf16 parameter through the pure clip + adamw (the clip used to promote it)
    params = {
        "s": torch.tensor(1.5, dtype=torch.bfloat16),
        "w": torch.ones(3, dtype=torch.bfloat16),
    }
    grads = {"s": torch.tensor(2.0, dtype=torch.bfloat16), "w": torch.ones(3, dtype=torch.bfloat16)}
    opt = optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(1e-2))
    theirs = {k: v.clone().requires_grad_() for k, v in params.items()}
    for k, t in theirs.items():
        t.grad = grads[k].clone()
    torch.nn.utils.clip_grad_norm_(theirs.values(), 0.1)
    torch.optim.AdamW(theirs.values(), lr=1e-2).step()
    updates, _ = opt.update(grads, opt.init(params), params)
    new = optim.apply_updates(params, updates)
    for k, t in theirs.items():
        assert new[k].dtype == torch.bfloat16 and torch.equal(new[k], t.detach()), k
    # numpy and tensor learning rates, as torch.optim accepts them; a tensor lr is read each step
    import numpy as np

    lr = torch.tensor(0.1)
    for rate in (np.float32(0.1), lr):
        p = {"w": torch.ones(2)}
        t = p["w"].clone().requires_grad_()
        topt = torch.optim.SGD([t], lr=rate)
        opt = optim.sgd(rate)
        state = opt.init(p)
        for _ in range(2):
            t.grad = torch.ones(2)
            topt.step()
            p, state = optim.step(opt, p, {"w": torch.ones(2)}, state)
            lr.fill_(0.05)
        assert torch.equal(p["w"], t.detach())
    with pytest.raises(TypeError, match="a tensor lr must hold one real number"):
        optim.adam(torch.ones(2))
    with pytest.raises(TypeError, match=r"lr='0\.1' is a str"):
        optim.adam("0.1")


def test_a_gradient_of_another_dtype_is_named():
    opt, params, state = _setup(optim.adamw(0.1))
    grads = {"a": torch.ones(3, dtype=torch.float64), "b": None, "ids": None}
    with pytest.raises(TypeError, match=r"adamw: grads\['a'\] is torch.float64 but the param"):
        opt.update(grads, state, params)
    with pytest.raises(TypeError, match=r"set_grads: grads\['a'\] is torch.float64"):
        optim.set_grads(params, grads)


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_kernel_as_torch_optim_fused(make):
    """``fused=True`` is torch's fused kernel: bit for bit ``torch.optim.*(fused=True)``, with a
    leaf without gradient for a while and two weight-decay groups (masked decay)."""
    g = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(50, 30, generator=g), "b": torch.randn(30, generator=g)}
    theirs = {k: v.clone().requires_grad_() for k, v in params.items()}
    topt = make(
        [{"params": [theirs["w"]]}, {"params": [theirs["b"]], "weight_decay": 0.0}],
        lr=0.03, weight_decay=0.1, fused=True,
    )  # fmt: skip
    ours = fs.optim.adamw if make is torch.optim.AdamW else fs.optim.adam
    opt = ours(0.03, weight_decay=0.1, mask=optim.at_least_2d, fused=True)
    state = opt.init(params)
    for step in range(6):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        grads["b"] = None if step in (1, 2) else grads["b"]
        for k, t in theirs.items():
            t.grad = None if grads[k] is None else grads[k].clone()
        topt.step()
        params, state = optim.step(opt, params, grads, state)
    for k, t in theirs.items():
        assert torch.equal(params[k], t.detach()), k


def test_fused_kernel_with_a_gradient_that_is_a_view():
    """A gradient that is a non-contiguous view (the shard of a dim other than 0, cut out of
    its padded chunk) is updated as the loop kernel does: torch's fused CPU kernel alone reads
    it as if it were contiguous (see [Note: fused kernels read dense gradients])."""
    g = torch.Generator().manual_seed(6)
    params = {"w": torch.randn(8, 2, generator=g)}
    loop = fs.optim.adamw(0.01, weight_decay=0.1)
    fused = fs.optim.adamw(0.01, weight_decay=0.1, fused=True)
    results = []
    for opt in (loop, fused):
        p = {k: v.clone() for k, v in params.items()}
        state = opt.init(p)
        for step in range(3):
            grad = torch.randn(8, 3, generator=torch.Generator().manual_seed(step))[:, :2]
            p, state = optim.step(opt, p, {"w": grad}, state)
        results.append(p["w"])
    torch.testing.assert_close(results[1], results[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("make", [lambda: fs.optim.adamw(1e-2), lambda: fs.optim.sgd(1e-2)])
def test_a_cuda_graph_capture_of_host_counts_is_refused(make):
    """A step captured into a CUDA graph would replay the captured bias correction and learning
    rate forever (the counts are host tensors): refused with the fix, as torch.optim refuses a
    capture without capturable=True. (Capture itself needs a GPU: the check is what runs.)"""
    params = {"w": torch.ones(3)}
    opt = make()
    state = opt.init(params)
    refused = pytest.raises(RuntimeError, match=r"captured into a CUDA graph.*capturable=True")
    with _mode.capture(), refused:
        fs.optim.step(opt, params, {"w": torch.ones(3)}, state)
    assert torch.equal(params["w"], torch.ones(3))  # refused before any update
    params, state = fs.optim.step(opt, params, {"w": torch.ones(3)}, state)
    assert int(state.count) == 1
