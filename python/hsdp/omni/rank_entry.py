"""The script each rank of an :class:`hsdp.Omni` runs (``python -m hsdp._rank rank_entry.py``)."""

import os
import sys

# hsdp._rank put this script's folder (inside the package) first on sys.path, as `python
# SCRIPT` does; its modules must not be importable as top-level names.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.getcwd()

from hsdp.omni.ranks import main

sys.exit(main())
