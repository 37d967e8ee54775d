"""What the zygote tests preload: the process that imported it."""

import os

IMPORTED_IN = os.getpid()
