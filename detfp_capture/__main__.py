"""``python -m detfp_capture``: run a training script under capture (see detfp_capture._launch.cli)."""

from __future__ import annotations

import sys

from detfp_capture._launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
