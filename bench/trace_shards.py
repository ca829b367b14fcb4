"""Sharded step writing (`trace.sharded`): what the learner writes, and what each train rank does.

One synthetic MoE step of production shape (bench/trace_scale.py's ``synthetic_step``: at
``--scale 1`` 64 samples × 16 384 tokens, 48 layers, top-8 of 128 experts) is written, side by side
in one run:

* ``whole``: by one process, as the learner writes an unsharded step (``write_step``);
* ``sharded``: its samples split into ``--ranks`` contiguous shares, each written by a process of
  its own (forked, the share already in its memory as a rank holds it) with
  ``routing_rows`` + ``write_shard`` — what a train rank does — all at once, then the index by
  this process (``write_sharded_step``), as the learner does.

Keys: ``learner_write_s_whole`` / ``learner_write_s_sharded`` (what the learner's writer thread
spends on the step), ``learner_bytes_fraction`` (the index's bytes over the whole file's),
``rank_write_s_max`` (the slowest rank's shard), ``sharded_wall_s`` (ranks in parallel, then the
index), ``read_s_whole`` / ``read_s_sharded`` (``StepFile`` reading ``/routing/train`` and
``/tokens/old_logprob`` whole, fresh process each: the virtual datasets' cost on read),
``same_arrays`` (every dataset of the two files read back equal), and what the learner's process
holds of the step in memory, over the whole record's bytes: ``learner_holds_fraction`` (the
sharded path without R3: token columns and tables; both routings stay on the rollout actor and
the ranks) and ``learner_holds_fraction_r3`` (under R3 the engine's routing is in the training
batch the learner builds, so it holds that too). Those two count the record's array bytes
(``nbytes``), the rest are measured times and file sizes.

    OMP_NUM_THREADS=1 python bench/trace_shards.py --scale 0.25 --ranks 2 [--encoding packed]

Last stdout line: one JSON object with those keys.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_scale import synthetic_step  # noqa: E402

from axrl.trace import StepRecord, read_step, write_step  # noqa: E402
from axrl.trace.shards import routing_rows, write_shard, write_sharded_step  # noqa: E402

READ = """
import sys, time
from axrl.trace import StepFile
t0 = time.perf_counter()
with StepFile(sys.argv[1]) as sf:
    sf.read_columns(["/routing/train", "/tokens/old_logprob"])
print(time.perf_counter() - t0)
"""


def rank_write(rec: StepRecord, trace: Path, name: str, lo: int, hi: int, encoding: str, out: mp.Queue) -> None:
    """A rank's work: its samples' routing rows to the stored form, then its shard file."""
    t0 = time.perf_counter()
    off = np.asarray(rec.sample_offsets)
    a, b = int(off[lo]), int(off[hi])
    rows, attrs = routing_rows(rec.routing_rollout[a:b], rec.routing_train[a:b], off[lo:hi + 1] - a,
                               rec.num_experts, encoding)
    info = write_shard(trace, rec.step, name, a, b, rows, attrs)
    out.put((info, time.perf_counter() - t0))


def sharded(rec: StepRecord, trace: Path, ranks: int, encoding: str) -> dict[str, float]:
    n = len(rec.sample_offsets) - 1
    cuts = np.linspace(0, n, ranks + 1).round().astype(int)
    out: mp.Queue = mp.get_context("fork").Queue()
    t0 = time.perf_counter()
    procs = [mp.get_context("fork").Process(target=rank_write, args=(rec, trace, f"train_rank{r}", lo, hi, encoding, out))
             for r, (lo, hi) in enumerate(zip(cuts, cuts[1:]))]
    for p in procs:
        p.start()
    done = [out.get() for _ in procs]
    for p in procs:
        p.join()
    t1 = time.perf_counter()
    rest = StepRecord(**{**rec.__dict__, "routing_rollout": None, "routing_train": None,
                         "routing_rollout_valid": None})
    index = write_sharded_step(trace, rest, [i for i, _ in done])
    t2 = time.perf_counter()
    return {"learner_write_s_sharded": t2 - t1, "rank_write_s_max": max(s for _, s in done),
            "sharded_wall_s": t2 - t0, "index_bytes": index.stat().st_size}


def record_bytes(rec: StepRecord) -> int:
    """The bytes of the arrays a step record holds (nested mappings included)."""
    def size(v: object) -> int:
        if isinstance(v, np.ndarray):
            return int(v.nbytes)
        if isinstance(v, dict):
            return sum(size(x) for x in v.values())
        return 0
    return sum(size(v) for v in rec.__dict__.values())


def read_s(path: Path) -> float:
    return float(subprocess.run([sys.executable, "-c", READ, str(path)], check=True, capture_output=True,
                                text=True).stdout.split()[-1])


def same(a: dict, b: dict) -> bool:
    keys = [k for k in a if k not in ("attrs", "group_attrs")]
    return a.keys() == b.keys() and all(
        np.asarray(a[k]).tolist() == np.asarray(b[k]).tolist() if np.asarray(a[k]).dtype == object
        else np.array_equal(a[k], b[k], equal_nan=np.asarray(a[k]).dtype.kind == "f") for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--encoding", choices=["raw", "packed"], default="raw", help="trace.routing_encoding")
    args = ap.parse_args()
    rec = synthetic_step(args.scale)
    root = Path(tempfile.mkdtemp(prefix="axrl-shards-"))
    try:
        t0 = time.perf_counter()
        whole = write_step(root / "whole", rec, routing_encoding=args.encoding)
        res = {"tokens": int(rec.sample_offsets[-1]), "ranks": args.ranks, "encoding": args.encoding,
               "learner_write_s_whole": time.perf_counter() - t0, "whole_bytes": whole.stat().st_size}
        res.update(sharded(rec, root / "sharded", args.ranks, args.encoding))
        index = root / "sharded" / whole.name
        res["learner_bytes_fraction"] = res["index_bytes"] / res["whole_bytes"]
        res["learner_write_ratio"] = res["learner_write_s_sharded"] / res["learner_write_s_whole"]
        res["read_s_whole"], res["read_s_sharded"] = read_s(whole), read_s(index)
        res["same_arrays"] = same(read_step(whole), read_step(index))
        rest = StepRecord(**{**rec.__dict__, "routing_rollout": None, "routing_train": None,
                             "routing_rollout_valid": None})
        total = record_bytes(rec)
        res["learner_holds_fraction"] = record_bytes(rest) / total
        res["learner_holds_fraction_r3"] = (record_bytes(rest) + int(np.asarray(rec.routing_rollout).nbytes)) / total
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
