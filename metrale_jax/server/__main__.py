"""`python -m metrale_jax.server MODEL ...`: the same as `metrale serve MODEL ...`."""

import sys

from metrale_jax.server.cli import main

sys.exit(main())
