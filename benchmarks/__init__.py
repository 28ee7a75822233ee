"""funcshard vs FSDP2, side by side: ``python -m benchmarks.run`` (``make bench``).

Modules: ``workloads`` (the models), ``variants`` (the frameworks, one small function each),
``harness`` (alternating timing, machine description, JSON), one module per part (``step_time``,
``memory``, ``comms``, ``overhead``, ``timeline``, ``scale``), ``ranks`` (the torchrun entry),
``run`` (the driver) and ``report`` (JSON -> BENCHMARKS.md tables and plots).
"""
