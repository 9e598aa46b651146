"""`python -m kdj.cli ...`: the `kdj` command."""

import sys

from kdj.cli import main

sys.exit(main())
