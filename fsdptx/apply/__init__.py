"""The apply layer: ``apply_plan``/``check_plan`` (``_apply``) and the
unused-parameter reduction they carry out (``_unused``). The only layer
below ``compat`` that mutates a model."""
