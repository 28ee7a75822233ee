"""Layer 6 of 6, execution: a plan run.

The plan lowered per structure and mode (``_program``), the scheduler that follows it
(``_schedule``), recompute and its regions (``_recompute``, ``_regions``, ``_region_key``),
differentiation of a scheduled or transformed function (``_autodiff``), the whole step as a CUDA
graph (``_cuda_graph``) and traced once and compiled (``_jit``, ``_pieces``), with what both
key a call by (``_signature``) and refuse on the host (``_host``). Imports the layers below.
"""
