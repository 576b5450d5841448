"""``python -m fsdptx plan``: the dry run (``_main``) and the memory and
traffic report it prints (``_report``)."""
