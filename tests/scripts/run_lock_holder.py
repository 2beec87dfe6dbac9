"""A live run holding an output directory's lock: takes it (`run_lock.acquire`), prints ``held``, then waits until
its stdin closes (or it is killed: SIGKILL leaves the lock behind, as a killed run does).

    python run_lock_holder.py OUTPUT_DIR
"""

import sys

from trl_distill.runtime.run_lock import acquire

lock = acquire(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
lock.release()
