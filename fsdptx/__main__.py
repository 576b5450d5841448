"""``python -m fsdptx``: see :mod:`fsdptx._cli`."""

import sys

from ._cli import main

sys.exit(main())
