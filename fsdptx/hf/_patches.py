"""Patches of ``transformers`` behaviour that costs training time.

Each patch is opt-in, idempotent and a no-op where ``transformers`` (or the
patched function) is absent, so importing this module needs torch alone.
"""

from __future__ import annotations

__all__ = ["patch_is_packed_sequence"]

_PATCHED = "_fsdptx_unpacked"


def patch_is_packed_sequence() -> bool:
    """Make ``transformers``' packed-sequence check return ``False`` at once.

    That check returns a device tensor when the batch size is 1, and Python's
    ``if`` on it synchronizes the CPU with the GPU, once per attention layer
    and forward (hundreds of times per step with TP and checkpointing). For
    ordinary training, where no sequence is packed, ``False`` is the right
    answer. Do NOT use this for packed-sequence training (several sequences
    concatenated in one row, ``position_ids`` restarting at 0): their
    attention would then cross sequence boundaries.

    Idempotent; returns whether the check is patched (False without
    ``transformers``, or with a version that has no such check: nothing to
    patch, so nothing is added to it).

    Returns:
        Whether the check is patched.

    Example::

        if not fsdptx.patch_is_packed_sequence():
            print("nothing to patch")
    """
    try:
        from transformers import modeling_flash_attention_utils as fa
    except ImportError:
        return False
    current = getattr(fa, "_is_packed_sequence", None)
    if current is None:
        return False
    if getattr(current, _PATCHED, False):
        return True

    def _not_packed(position_ids: object, batch_size: object) -> bool:
        del position_ids, batch_size
        return False

    setattr(_not_packed, _PATCHED, True)
    fa._is_packed_sequence = _not_packed
    return True
