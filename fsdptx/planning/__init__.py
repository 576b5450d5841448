"""Planning and applying FSDP units: the Plan and its units (``_plan``), the
pure planner (``_planner``), the transforms and ``compose`` (``_transforms``,
``_refine``), ``apply_plan`` (``_apply``), and the seed-compatible
imperative API built on them (``_imperative``). The public names are
re-exported by :mod:`fsdptx`."""
