"""`python -m hftrain ...` and `accelerate launch -m hftrain ...` run the same CLI as `hftrain`."""

import sys

from .cli import main

sys.exit(main())
