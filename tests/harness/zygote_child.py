"""Run by the zygote tests as ``python -m``: says what it sees, then exits as argv asks."""

from __future__ import annotations

import atexit
import json
import os
import sys

import tests.harness.zygote_preload as preload

atexit.register(lambda: print("atexit ran", flush=True))
print(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "name": __name__,
            "cwd": os.getcwd(),
            "env": os.environ.get("ZYGOTE_TEST_VALUE"),
            "imported_in": preload.IMPORTED_IN,
            "pid": os.getpid(),
        }
    ),
    flush=True,
)
if sys.argv[1] == "sleep":
    import time

    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1] != "sleep" else 0)
