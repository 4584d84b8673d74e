"""`python -m bench.fleet`: see the package docstring (bench/fleet/__init__.py)."""

import sys

from bench.fleet.main import main

sys.exit(main())
