"""Layer 2 of 6, trees: parameters as data.

Tree helpers (``_tree``), a module's parameters extracted into trees and bound back for a call
(``_extract``, ``_deferred``, ``_activation_checkpoint``), shard specs and DTensor (``_spec``,
``_dtensor``), meshes and tensor-parallel layouts (``_parallel``), modules on meta and their
construction (``_meta``, ``_construction``, ``_materialize_steps``). Imports ``_runtime`` only.
"""
