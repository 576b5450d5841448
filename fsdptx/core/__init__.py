"""Pure building blocks: tree walks, dtypes, policies, chunks, names, sizes,
argument checks, meshes, globs.

The lowest layer: imports nothing else from fsdptx. The contract's names,
the command line and ``fsdptx.testing``'s names pass through here before
anything else imports torch, so torch is imported here, once, quietly: torch
warns "Failed to initialize NumPy" on import when numpy is missing; fsdptx
depends on torch alone and never needs numpy, so that warning is only noise
(it would be the first line of every ``python -m fsdptx plan``). The filter
is scoped to this import: none stays installed."""

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401
