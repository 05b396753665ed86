"""The script each rank of a self-launched ``hsdp`` command runs: ``python -m hsdp._rank
rank_entry.py COMMAND ARGS``, exactly ``python -m hsdp COMMAND ARGS`` inside the job."""

import os
import sys

# hsdp._rank put this script's folder first on sys.path, as `python SCRIPT` does; the folder
# is inside the package, so its modules must not be importable as top-level names.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.getcwd()

from hsdp.__main__ import main  # noqa: E402

sys.exit(main())
