"""`python -m tests.support.lock_holder DIR KEY`: another launch that owns DIR (as a run or a prepare would) until
killed."""

import sys
import time

from hftrain.checkpoint.output_lock import owning

if __name__ == "__main__":
    with owning(sys.argv[1], sys.argv[2]):
        print("held", flush=True)
        time.sleep(600)
