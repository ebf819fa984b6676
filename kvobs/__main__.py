"""`python -m kvobs demo ...`: the same as the `kvobs` command."""

import sys

from kvobs.cli import main

sys.exit(main())
