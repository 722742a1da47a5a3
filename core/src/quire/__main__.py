"""``python -m quire``: the ``quire`` command."""

import sys

from quire._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
