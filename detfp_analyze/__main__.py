"""``python -m detfp_analyze`` is the ``detfp-analyze`` command."""

from detfp_analyze.cli import main

if __name__ == "__main__":
    main()
