"""Layer 6 of 6, execution: a plan run.

The plan lowered per structure and mode (``_program``), the scheduler that follows it
(``_schedule``), recompute and its regions (``_recompute``, ``_regions``), differentiation of a
scheduled or transformed function (``_autodiff``) and the whole step as a CUDA graph
(``_cuda_graph``). Imports the layers below.
"""
