"""`--dump`: the deep dump of step N, written while it is re-executed. The probe and the file
format live in `axrl.runtime.recording.dump` (the online spike trigger writes the same file during
training); this module is replay's name for them."""

from axrl.runtime.recording.dump import DUMP_DIR, DUMP_FORMAT, DUMP_VERSION, DumpProbe, dump_path, read_dump

__all__ = ["DUMP_DIR", "DUMP_FORMAT", "DUMP_VERSION", "DumpProbe", "dump_path", "read_dump"]
