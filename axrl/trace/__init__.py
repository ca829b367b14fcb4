"""The AxRL trace: one crash-safe HDF5 file per training step inside a run directory.

See docs/trace-format.md for the on-disk format (the public contract).
"""

from .schema import (
    SCHEMA_VERSION,
    CorruptStepError,
    NotARunDirError,
    SchemaVersionError,
    TraceError,
    TraceValidationError,
    routing_dtype,
    step_file_name,
)
from .writer import StepRecord, write_step
from .run_dir import RunDir, read_metrics_file
from .columns import StepColumns
from .reader import TraceProblem, TraceReader
from .step_file import StepFile, read_step
from .recorder import Recorder, RecorderError

__all__ = [
    "SCHEMA_VERSION",
    "CorruptStepError",
    "NotARunDirError",
    "Recorder",
    "RecorderError",
    "RunDir",
    "SchemaVersionError",
    "StepColumns",
    "StepFile",
    "StepRecord",
    "TraceError",
    "TraceProblem",
    "TraceReader",
    "TraceValidationError",
    "read_metrics_file",
    "read_step",
    "routing_dtype",
    "step_file_name",
    "write_step",
]
