"""The seed-compatible imperative API (``fully_shard_by_dtype``,
``fully_shard_across_blocks`` and their memo) and the MTP guards, built on
the layers below (``_imperative``)."""
