"""``python -m torchimpl.cli``: the ``ampspec`` command."""

import sys

from torchimpl.cli.app import main

sys.exit(main())
