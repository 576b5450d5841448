"""The apply layer, the only one below ``compat`` that mutates a model:
``apply_plan`` (``_apply``) after every check (``_check``), and one file per
effect it carries out: tensor parallelism's repairs (``_tp``), activation
checkpointing (``_checkpoint``), expert parallelism (``_experts``), FSDP units
(``_fsdp``), fp32 inputs for fp32 modules (``_inputs``) and the
unused-parameter reduction (``_unused``)."""
