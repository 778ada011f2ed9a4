"""`python -m tokenmill ...` is the `tokenmill` command (and torchrun's module: `torchrun ... -m tokenmill serve`)."""

import sys

from tokenmill.entrypoints.cli import main

sys.exit(main())
