"""``python -m quire``: the ``quire`` command."""

import sys

from quire._cli import main

if __name__ == "__main__":
    sys.exit(main())
