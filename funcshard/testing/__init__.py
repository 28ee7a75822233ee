"""Testing sharded code: run it on several ranks from one test, and check it against full tensors.

- :func:`run` / :class:`Pool`: call a function on ``world`` local rank processes with the
  default process group initialised (gloo by default; no launcher, no environment variables,
  no fixed ports) and get the per-rank results back; :class:`RankError` when a rank raises or
  hangs.
- :func:`assert_close` and :func:`reference_value_and_grad` (on the ranks): compare sharded
  trees with full tensors, and compute the unsharded reference of a training step.
- :func:`check_plan` (anywhere): check a plan against a module with a dry run on meta tensors.

See ``docs/testing.md``.
"""

from ._check_plan import PlanCheck, check_plan
from ._pool import Pool, RankError, run
from ._reference import assert_close, reference_value_and_grad

__all__ = [
    "PlanCheck",
    "Pool",
    "RankError",
    "assert_close",
    "check_plan",
    "reference_value_and_grad",
    "run",
]
