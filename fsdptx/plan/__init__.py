"""The plan layer: the Plan and its records (``_types``, which imports only
``core``), what kind each transform is (``_kinds``), resolving sharding
requests into units (``_resolve``), vouching (``_vouch``), the transforms and
``compose``/``plan`` (``_transforms``, ``_refine``), and plan files
(``_json``, ``_diff``). Imports ``core``, ``hf`` and ``model``. The public
names are re-exported by :mod:`fsdptx`."""
