"""Safetensors checkpoints: validated reading and writing, and the streaming rank-local load.

``load_model_sharded(model, checkpoint, hsdp_config)`` shards a meta-initialised model block
by block and fills each rank's shard straight from the file (only that rank's bytes are
read). ``load_model_whole`` + ``hsdp.apply_hsdp_to_model`` is the simple strategy it is
measured against. See docs/checkpoints.md.

Module map: ``format`` (one file: dtypes, header validation), ``index`` (multi-file
checkpoints), ``writer`` (``save_checkpoint``), ``plan`` (names, shapes, dtypes),
``whole`` (whole tensors), ``stream`` (the sharded load), ``progress``.
"""

from .errors import CheckpointError, CheckpointKeyError
from .format import MAX_HEADER_BYTES, SafetensorsFile, TensorEntry, open_safetensors
from .index import Checkpoint, open_checkpoint
from .plan import KeyMap, LoadPlan, plan_load
from .progress import LoadProgress, LoadReport, load_report
from .stream import load_model_sharded
from .whole import load_checkpoint, load_model_whole, read_tensor
from .writer import save_checkpoint

__all__ = [
    "MAX_HEADER_BYTES",
    "Checkpoint",
    "CheckpointError",
    "CheckpointKeyError",
    "KeyMap",
    "LoadPlan",
    "LoadProgress",
    "LoadReport",
    "SafetensorsFile",
    "TensorEntry",
    "load_checkpoint",
    "load_model_sharded",
    "load_model_whole",
    "load_report",
    "open_checkpoint",
    "open_safetensors",
    "plan_load",
    "read_tensor",
    "save_checkpoint",
]
