"""`better-compute reserve|extend|…`: kept as an entry point; the client lives in controlplane.client."""

from __future__ import annotations

import sys

from controlplane.client.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
