"""``python -m fsdptx``: see :mod:`fsdptx.cli._main`."""

import sys

from .cli._main import main

sys.exit(main())
