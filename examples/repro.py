"""The reproduction as a script: same as `lmcache-hma repro` (see lmcache_hma/tools/repro.py).

    python examples/repro.py [--config configs/disk.yaml] [--model /path/to/model]
"""

import sys

from lmcache_hma.tools.repro import main

if __name__ == "__main__":  # vLLM on CPU spawns processes: the guard is required
    sys.exit(main())
