"""`python -m shardforge` is the same as the `shardforge` command."""

import sys

from shardforge.cli import main

sys.exit(main())
