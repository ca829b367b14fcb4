"""Weight transport between the trainer and rollout servers: a named process group (trainer =
rank 0 broadcasting, servers = ranks 1..n receiving) and HF directories on disk.

The process group is built the way SGLang builds its weight-update group (a `tcp://`
rendezvous whose store is prefixed by the group name, then a non-default process group), so
the trainer side here interoperates with a real SGLang server's `/init_weights_update_group`
and with `axrl serve`, which uses the receiving half of this module. No default process group
is needed on either side, and the trainer may already have one (e.g. for Megatron).

Tensors travel in the order of `names`, one broadcast each: a receiver allocates
`empty(shape, dtype)` per name and joins the same sequence of broadcasts.
"""

from __future__ import annotations

import datetime
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from safetensors.torch import save_file

# dtype names on the wire are torch attribute names (SGLang does `getattr(torch, name)`).
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32",
                                                  "uint8", "int8", "bool")}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype ("float32", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str = "dtypes") -> torch.dtype:
    """Parse a wire dtype name; ValueError names `where` on anything unknown."""
    if not isinstance(name, str) or name.removeprefix("torch.") not in _DTYPES:
        raise ValueError(f"{where}: unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name.removeprefix("torch.")]


def init_weights_group(*, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                       backend: str = "gloo", timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Join (rank 0: host) the named weight-update group; blocks until all `world_size` ranks joined.

    Rank 0 runs the rendezvous store on `master_address:master_port`. `timeout_s` bounds the
    rendezvous and every later collective, so a receiver that never shows up fails the sender
    instead of hanging it.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    # Prefixing keeps this group's keys apart from any other user of the same store.
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         timeout=timeout)
    # Group ranks = global ranks for collectives on this group (there may be no default group).
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weights_group(group: dist.ProcessGroup | None) -> None:
    """Tear a weight-update group down (best effort: a peer may already be gone)."""
    if group is None:
        return
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 — a half-dead group still has to be forgotten
        pass


def broadcast_weights(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Rank 0: send `tensors` (CPU, contiguous) to every receiver, in order."""
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()


def receive_weights(group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[str],
                    shapes: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """Rank > 0: receive one broadcast per name into fresh tensors of the announced dtype/shape."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes must have the same length, got {len(names)}, "
                         f"{len(dtypes)} and {len(shapes)}")
    tensors = {name: torch.empty([int(d) for d in shape], dtype=dtype_from_name(dt))
               for name, dt, shape in zip(names, dtypes, shapes)}
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors.values()]
    for work in works:
        work.wait()
    return tensors


def buckets(state_dict: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Split names into consecutive buckets of at most `max_bytes` (a bigger tensor goes alone), so
    a receiver never holds more than one bucket of staging copies at once."""
    out: list[list[str]] = [[]]
    size = 0
    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return [b for b in out if b]


def export_weights(state_dict: Mapping[str, torch.Tensor], model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write an HF directory: `state_dict` as model.safetensors plus config.json and tokenizer
    files copied from `model_dir`. Written under a temporary name and renamed, so a server never
    reads a half-written directory."""
    src, out = Path(model_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src / 'config.json'} not found: weight export copies the model's config from there")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and (f.suffix in (".json", ".jinja", ".txt", ".model") and f.name != "model.safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def send_list(state_dict: Mapping[str, torch.Tensor], names: Iterable[str], backend: str) -> list[torch.Tensor]:
    """Detached, contiguous tensors for `names` where `backend` can send them: CPU memory for
    gloo, the trainer's own (CUDA) tensors for nccl."""
    return [(state_dict[n].detach().to("cpu") if backend == "gloo" else state_dict[n].detach()).contiguous()
            for n in names]


def describe(state_dict: Mapping[str, torch.Tensor], names: Sequence[str]) -> dict[str, Any]:
    """The `/update_weights_from_distributed` metadata for `names`."""
    return {"names": list(names), "dtypes": [dtype_name(state_dict[n].dtype) for n in names],
            "shapes": [list(state_dict[n].shape) for n in names]}
