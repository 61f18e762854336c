"""`python -m recps.launch`: start S servers and W workers of one command on this machine and supervise them.

    python -m recps.launch --servers 1 --workers 2 -- python my_train.py --lr 0.1

An entry point only: the launcher is recps.cluster.launch (import it from there).
"""

import sys

from recps.cluster.launch import main

if __name__ == "__main__":
    sys.exit(main())
