"""Layer 1 of 6, runtime: what every other layer asks of torch and of the running call.

torch's versions and private APIs (``_compat``), the execution mode (``_mode``), funcshard's
code in a ``torch.compile`` graph (``_compile``), profiler spans (``_profiling``) and the call's
gradient sink (``_sink``). Imports no other layer.

The layers, lowest first -- each imports only those below it (``tests/test_layers.py``):
``_runtime``, ``_trees``, ``_communication``, ``transforms``, ``_plans``, ``_execution``; then
``optim``, ``checkpoint``, ``testing`` and ``_pricing`` (``fs.explain``, ``fs.autoplan``) above.
"""
