"""`python -m hftrain ...` and `accelerate launch -m hftrain ...` run the same CLI as `hftrain`."""

import sys

from hftrain.cli import program

sys.exit(program())
