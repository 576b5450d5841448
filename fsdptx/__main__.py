"""``python -m fsdptx``: see :mod:`fsdptx.cli._main`."""

import sys

# fsdptx.core imports torch quietly (see there); import fsdptx no longer does,
# so the command line passes through it before its first torch import.
from . import core  # noqa: F401
from .cli._main import main

sys.exit(main())
