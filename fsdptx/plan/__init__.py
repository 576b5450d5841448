"""The plan layer: the Plan (``_plan``), its records (``_types``, which
imports no fsdptx module), rendering a Plan as text (``_format``, which
imports ``core``), what kind each transform is (``_kinds``), resolving
sharding requests into units (the ``resolve`` subpackage: the resolver,
dtype units, cross-block units, block replay), vouching (``_vouch``),
composing and running transforms (``_compose``: ``compose``, ``plan``), the
transforms themselves (the ``transforms`` subpackage: sharding, marks,
refinements, expert parallelism), and plan files (``_json``, ``_diff``).
Imports ``core``, ``hf`` and ``model``. The public names are re-exported by
:mod:`fsdptx`."""
