"""`python -m kvtier.cli`: the `kvtier` command."""

from __future__ import annotations

import sys

from kvtier.cli.main import main

sys.exit(main())
