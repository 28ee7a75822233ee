"""What differs between the torch versions funcshard supports (2.11 to 2.13), in one place.

[Note: supported torch versions]
funcshard runs on torch 2.11, 2.12 and 2.13, eagerly and under ``torch.compile``
(``pyproject.toml`` declares the range); CI tests 2.13, and ``make test-compile
TORCH=2.11.0`` runs the compile tests on another version (docs/compile.md). Where a newer
torch renamed an API, the newer name is used when present; where an older one lacks what
funcshard needs, the replacement is here (``compiling``).
"""

from __future__ import annotations

import contextlib
import copyreg
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

# private: see tests/test_compile.py::test_private_torch_apis_of_compat
from torch._guards import TracingContext

# private: torch's rule for the output of aten._grouped_mm (size, strides, dtype), which its fake
# kernel applies only to bfloat16 inputs (see [Note: grouped matmuls on fake tensors]);
# tests/test_explain.py::test_private_torch_api_of_grouped_mm
from torch._meta_registrations import _create_grouped_mm_output_tensor

# private: a dispatch mode meets the higher-order operators left in a compiled graph (see
# [Note: a compiled step captured]); tests/test_cuda_graph.py::
# test_a_compiled_step_is_captured_on_the_stand_in runs them through one
from torch._ops import HigherOrderOperator  # noqa: F401 (re-exported)

TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
HAS_2_13 = TORCH >= (2, 13)

# torch 2.13 renamed the in-place all-gather into one tensor (the old name warns there)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def storage_key(t: torch.Tensor | torch.UntypedStorage) -> int:
    """The identity of ``t``'s storage (or of the storage ``t``), shared by its views: the
    address of its StorageImpl
    (not of its data: a fake tensor's data pointer is always 0, and a freed storage's too).
    Private (``_cdata``): see tests/test_compile.py::test_private_torch_apis_of_compat."""
    return (t.untyped_storage() if isinstance(t, torch.Tensor) else t)._cdata


# fs.jit tracing a step, in any thread: see [Note: compiling() while fs.jit traces]
_STEP_TRACES = [0]


@contextlib.contextmanager
def tracing_step() -> Iterator[None]:
    """Make :func:`compiling` true in the body: ``fs.jit`` traces a step.

    [Note: compiling() while fs.jit traces]
    ``fs.jit`` traces a step with ``make_fx``, where funcshard's code must take the paths it
    takes under ``torch.compile`` (functional collectives waited where used, no frees, host
    checks once, the optimizer's count as a tensor). That is funcshard's question, so the answer
    is funcshard's: a count of the traces running, not torch's private compiling flag (which
    every torch library reads). It is a count for the process, not a context variable, because
    the backward of a CUDA step is traced in autograd's device thread, which sees no context
    variable of the thread that called ``torch.autograd.grad``; one process traces one step at a
    time.
    """
    _STEP_TRACES[0] += 1
    try:
        yield
    finally:
        _STEP_TRACES[0] -= 1


def compiling() -> bool:
    """Whether code runs as part of a ``torch.compile`` session or of ``fs.jit``'s trace:
    traced by Dynamo, or run by it or AOTAutograd while they trace (a ``nonstrict_trace``
    function, a backward), or traced by ``fs.jit`` (:func:`tracing_step`).

    [Note: a compile session on torch 2.11 and 2.12]
    From torch 2.13 ``torch.compiler.is_compiling()`` is true for the whole compile session,
    including the code Dynamo does not trace itself (``nonstrict_trace`` functions, which is
    how funcshard's transforms are traced, and the backward AOTAutograd traces). On 2.11 and
    2.12 it is true only in code Dynamo traces, so funcshard's Python, run on fake tensors while
    compiling, would take its eager paths (pending collectives, storage frees, meta tensors made
    under the fake mode) and fail. There the session is told by the ``TracingContext`` that
    Dynamo installs while it compiles a frame (AOTAutograd and the backend run inside it) and
    that no compiled graph has at run time.
    """
    if _STEP_TRACES[0] or torch.compiler.is_compiling():
        return True
    return not HAS_2_13 and TracingContext.try_get() is not None


def _mesh_reduced(mesh) -> tuple:
    """``mesh``'s pickle, without the hash it caches: see [Note: a mesh in a cache key]."""
    reduced = object.__reduce_ex__(mesh, 2)
    if len(reduced) < 3 or not isinstance(reduced[2], dict) or "_hash" not in reduced[2]:
        return reduced
    state = {k: v for k, v in reduced[2].items() if k != "_hash"}
    return (*reduced[:2], state, *reduced[3:])


def keep_mesh_hash_out_of_pickles() -> bool:
    """Pickle ``DeviceMesh`` without its cached ``hash()`` (idempotent); whether it applies.

    [Note: a mesh in a cache key]
    A compiled step takes DTensors, and from torch 2.13 each one enters the graph as its local
    tensor and its ``DeviceMesh``, an opaque object. Inductor's FX graph cache keys a graph by a
    pickle of its inputs, the mesh's attributes among them, and a mesh caches its ``hash()`` in
    ``_hash`` once anything hashed it. ``hash()`` of a string differs between processes (Python
    salts it, ``PYTHONHASHSEED``), so every process computed another key for the same graph and
    no second process ever found the graph the first had compiled. The mesh pickles without it
    here (torch's own pickle, less that attribute; an unpickled mesh computes it again when
    hashed, as a new one does), so the key depends on what the mesh is. Registered once, for
    ``DeviceMesh`` itself, in ``copyreg``, where every pickler finds it (inductor's copies it).
    ``tests/test_compile_cache.py`` checks that a second process hits the cache.
    """
    if not dist.is_available():
        return False
    from torch.distributed.device_mesh import DeviceMesh

    copyreg.pickle(DeviceMesh, _mesh_reduced)
    return True


def trace_graph(fn: Callable, tensors: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """``fn(*tensors)`` traced into a graph of ATen operators, on fake tensors made from
    ``tensors`` (``make_fx``), inside a ``TracingContext`` as Dynamo installs one (where
    ``invoke_subgraph`` traces each identifier's body once) and with :func:`tracing_step`.
    Private (``torch._guards``, fake tensors): see tests/test_jit.py::
    test_private_torch_apis_of_jit."""
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    fakes = [mode.from_tensor(t, static_shapes=True) for t in tensors]
    with tracing(TracingContext(mode)), tracing_step():
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*fakes)


def compile_graph(gm: torch.fx.GraphModule, tensors: Sequence[torch.Tensor]) -> Callable:
    """``gm`` compiled by inductor for inputs like ``tensors`` (real or fake: only their
    metadata is read); the compiled callable.

    [Note: a traced graph in the caches]
    Inductor's FX graph cache and AOTAutograd's cache key a graph only when it is compiled for
    fake inputs of a fake mode with a ``ShapeEnv``, inside a ``TracingContext`` -- as Dynamo
    hands a graph to its backend; a plain ``compile_fx(gm, real_tensors)`` bypasses both ("No
    shape env"). The key is the graph itself (its code, constants and inputs' metadata), so it
    holds everything funcshard's Python decided while tracing. Private (``compile_fx``,
    ``torch._guards``): see tests/test_jit.py::test_private_torch_apis_of_jit.
    """
    from torch._guards import tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                 for t in tensors]  # fmt: skip
    with tracing(TracingContext(mode)), torch.no_grad():
        return compile_fx(gm, fakes)


def fake_kernel(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` on fake tensors (called under a ``FakeTensorMode``), also for
    the operators whose fake kernel refuses inputs that their real kernel computes.

    [Note: grouped matmuls on fake tensors]
    ``aten._grouped_mm`` (the experts of Hugging Face's mixture-of-experts models -- Mixtral,
    Qwen3-MoE, DeepSeek-V3 -- through ``torch.nn.functional.grouped_mm``, forward and backward)
    computes float32 on CPU, but its fake kernel refuses every dtype but bfloat16 (the CUDA
    kernel's first limit), so a float32 step that runs could not be explained. For two inputs of
    one other floating dtype, the output is made by torch's own rule for its size and strides,
    in that dtype: what the real kernel returns. Only ``fs.explain``'s fake step runs this;
    torch's fake kernel is left as it is everywhere else.
    """
    if func is torch.ops.aten._grouped_mm.default:
        a, b = args[0], args[1]
        if a.dtype == b.dtype != torch.bfloat16 and a.is_floating_point():
            return _grouped_mm_output(*args, **kwargs)
    return func(*args, **kwargs)


def _grouped_mm_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype or mat_a.dtype)
