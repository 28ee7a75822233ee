"""Above the layers, pricing: a plan's cost before it runs.

``fs.explain`` runs the step on fake tensors and prices it (``_explain``, ``_explain_plot``),
its command line (``_explain_cli``, ``_explain_scale``, ``_fake_world``) and ``fs.autoplan``
(``_autoplan``). Imports any layer and ``optim``.
"""
