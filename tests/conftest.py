import sys
from pathlib import Path

# tests/mpirun.py is a helper module, imported by the multi-rank tests.
sys.path.insert(0, str(Path(__file__).parent))
