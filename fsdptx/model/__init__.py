"""The model layer: one walk of a model (``_walk``: FQN tables and the
signature a plan vouches for), the :class:`ModelIndex` built from it and the
model's blocks (``_index``), and what ``fully_shard`` refuses in a unit
(``_unit_checks``). Imports ``core`` only."""
