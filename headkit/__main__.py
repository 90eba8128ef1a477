"""``python -m headkit ...``: the same command line as the ``headkit`` console script."""

import sys

from .cli.main import main

sys.exit(main())
