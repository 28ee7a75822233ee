"""Layer 5 of 6, plans: what runs, as data.

Grouping policies (``_grouping``), the plan and its steps (``_plan``), the meshes of its groups
(``_plan_meshes``), the order recorded by a dry run of the transforms (``_record``) and the
merging of groups into buckets (``_bucketing``). Imports the layers below, ``transforms``
included.
"""
