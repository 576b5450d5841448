"""``python -m fsdptx plan``: the dry run (``_main``), the shape-only memory
and traffic report (``_report``), the traced training step (``_memory``),
``--fit`` (``_fit``) and ``--html`` (``_html``)."""
