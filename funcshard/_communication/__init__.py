"""Layer 3 of 6, communication: every collective, and the ranks' agreement.

The collectives as autograd Functions (``_collectives``), flat buffers and their copies
(``_flat``, ``_opaque``, ``_grad_layout``, ``_post_forward``), the store exchange and liveness
(``_store``, ``_liveness``), the per-call agreement of the ranks (``_consensus``, ``_counts``,
``_values``, ``_updates``) and the debug checks of collectives (``_debug``). Imports ``_runtime``
and ``_trees``.
"""
