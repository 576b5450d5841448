"""``python -m fsdptx plan``: the dry run (``_main``, ``_run``), the
shape-only memory and traffic report (``_report``), the traced training
step (``_trace``), its scaling to other shard sizes (``_scaling``), the
memory estimate built from both (``_memory``), ``--fit`` (``_fit``) and
``--html`` (``_html``)."""
