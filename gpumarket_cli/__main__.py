"""`python -m gpumarket_cli`, the same as the `gpumarket` console script."""

import sys

from gpumarket_cli.main import main

sys.exit(main())
