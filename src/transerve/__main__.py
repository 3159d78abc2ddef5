"""`python -m transerve` is the `transerve` command."""

import sys

from transerve.cli import main

sys.exit(main())
