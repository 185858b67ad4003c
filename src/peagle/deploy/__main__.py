"""``python -m peagle.deploy``: :func:`peagle.deploy.cli.main`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
