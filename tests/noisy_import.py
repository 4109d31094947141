"""A module that prints when it is imported, as some libraries do (test_warm_start.py)."""

import sys

print("noise printed at import", file=sys.stderr)
