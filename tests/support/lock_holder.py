"""`python -m tests.support.lock_holder DIR KEY [--fork]`: another launch that owns DIR (as a run or a prepare
would) until killed; with --fork it also forks a child from its main thread (a pool worker) that sleeps, and
prints its pid, after setting up what every hftrain command sets up for its children (parallel/process_end.py)."""

import os
import sys
import time

from hftrain.checkpoint.output_lock import owning
from hftrain.parallel import process_end

if __name__ == "__main__":
    with owning(sys.argv[1], sys.argv[2]):
        if "--fork" in sys.argv:
            process_end.children_end_with_this_process()
            child = os.fork()
            if child == 0:
                time.sleep(600)
                os._exit(0)
            print(f"child {child}", flush=True)
        print("held", flush=True)
        time.sleep(600)
