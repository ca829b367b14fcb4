"""The restricted unpickler (axrl_debug/importers/safe_load.py) against hostile dumps written
opcode by opcode: each must be refused AND leave the importing process as it was (no attribute
set on a torch / numpy class or singleton, no command run); real torch.save / pickle dumps of
tensors, arrays and plain containers still load."""

from __future__ import annotations

import builtins
import collections
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from axrl_debug.importers.safe_load import UnsafePickleError, load_dump

P2 = b"\x80\x02"       # PROTO 2


def _g(module: str, name: str) -> bytes:
    """GLOBAL module.name (pushes the object find_class resolves)."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _s(text: str) -> bytes:
    """SHORT_BINUNICODE text."""
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


EMPTY_DICT, MARK, TUPLE, TUPLE1, TUPLE2, TUPLE3 = b"}", b"(", b"t", b"\x85", b"\x86", b"\x87"
REDUCE, BUILD, NONE, SETITEM, STOP, NEWOBJ, OBJ = b"R", b"b", b"N", b"s", b".", b"\x81", b"o"
ONE = b"K\x01"


def _state_dict(key: str) -> bytes:
    """(None, {key: 1}): a BUILD state whose slot part is set with setattr."""
    return NONE + EMPTY_DICT + _s(key) + ONE + SETITEM + TUPLE2


def _snapshot(marker: Path) -> dict:
    """What a hostile dump might change in this process."""
    watched = (torch.storage.UntypedStorage, torch.storage.TypedStorage, torch.Tensor, torch.nn.Parameter,
               torch.Size, torch.device, np.ndarray, np.dtype, collections.OrderedDict)
    return {"classes": {c.__qualname__: dict(vars(c)) for c in watched},
            "builtins": dict(vars(builtins)), "f4": np.dtype("f4").str, "float32": repr(torch.float32),
            "marker": marker.exists()}


def hostile_cases(marker: Path) -> dict[str, bytes]:
    return {
        "GLOBAL setattr(UntypedStorage, …)": P2 + _g("builtins", "setattr") + _g("torch.storage", "UntypedStorage")
        + _s("pwned") + ONE + TUPLE3 + REDUCE + STOP,
        "GLOBAL getattr": P2 + _g("builtins", "getattr") + _g("torch", "Tensor") + _s("__setstate__")
        + TUPLE2 + REDUCE + STOP,
        "GLOBAL eval": P2 + _g("builtins", "eval") + _s("1") + TUPLE1 + REDUCE + STOP,
        "GLOBAL os.system": P2 + _g("os", "system") + _s(f"touch {marker}") + TUPLE1 + REDUCE + STOP,
        "GLOBAL functools.partial": P2 + _g("functools", "partial") + _g("torch", "Tensor") + TUPLE1 + REDUCE + STOP,
        "dotted name": P2 + _g("torch", "Tensor.__setstate__") + STOP,
        "dotted storage name": P2 + _g("torch", "storage.UntypedStorage") + STOP,
        "BUILD on UntypedStorage": P2 + _g("torch.storage", "UntypedStorage") + _state_dict("pwned") + BUILD + STOP,
        "BUILD on torch.Tensor": P2 + _g("torch", "Tensor") + EMPTY_DICT + _s("pwned") + ONE + SETITEM + BUILD + STOP,
        "BUILD on a torch dtype": P2 + _g("torch", "float32") + _state_dict("pwned") + BUILD + STOP,
        "BUILD on numpy.ndarray": P2 + _g("numpy", "ndarray") + _state_dict("pwned") + BUILD + STOP,
        "BUILD on an OrderedDict": P2 + _g("collections", "OrderedDict") + b")" + REDUCE
        + _state_dict("pwned") + BUILD + STOP,
        "calling a storage class": P2 + _g("torch.storage", "UntypedStorage") + b"K\x08" + TUPLE1 + REDUCE + STOP,
        "NEWOBJ of a torch dtype": P2 + _g("torch", "float32") + b")" + NEWOBJ + STOP,
        "OBJ of a torch dtype": P2 + MARK + _g("torch", "float32") + OBJ + STOP,
        "tensor state setting __class__": P2 + _g("torch", "Tensor") + b")" + REDUCE
        + _state_dict("__class__") + BUILD + STOP,
        # _rebuild_from_type_v2(UntypedStorage, Tensor, (4,), None): its inner call is policed too
        "rebuild_from_type calling a storage class": P2 + _g("torch._tensor", "_rebuild_from_type_v2") + MARK
        + _g("torch.storage", "UntypedStorage") + _g("torch", "Tensor") + b"K\x04" + TUPLE1 + NONE + TUPLE
        + REDUCE + STOP,
        "rebuild_parameter with a backward hook": P2 + _g("torch._utils", "_rebuild_parameter")
        + _g("torch", "Tensor") + b")" + REDUCE + b"\x88" + EMPTY_DICT + ONE + _g("collections", "OrderedDict")
        + SETITEM + TUPLE3 + REDUCE + STOP,
    }


class _Nested:
    """`__reduce_ex__` returning an allowed container whose items reduce to os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce_ex__(self, protocol: int):
        import os
        inner = type("Cmd", (), {"__reduce__": lambda _s: (os.system, (f"touch {self.marker}",))})()
        return collections.OrderedDict, (), None, None, iter([("k", inner)])


@pytest.mark.parametrize("name", list(hostile_cases(Path("/x"))))
def test_hostile_dump_is_refused_and_changes_nothing(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "PWNED"
    cases = hostile_cases(marker)
    dump = tmp_path / "dump.pt"
    dump.write_bytes(cases[name])
    before = _snapshot(marker)
    with pytest.raises(UnsafePickleError, match=str(dump)):
        load_dump(dump)
    after = _snapshot(marker)
    assert after == before, name
    assert not marker.exists()


def test_nested_reduce_ex_and_torch_save_of_a_hostile_object_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    dumps = []
    for i, save in enumerate((torch.save, lambda o, p: p.write_bytes(pickle.dumps(o, protocol=2)))):
        dumps.append(tmp_path / f"nested{i}.pt")
        save({"x": torch.ones(2) if i == 0 else [1.0], "nested": _Nested(marker)}, dumps[-1])
    before = _snapshot(marker)          # after saving: pickling itself may cache on the classes
    for dump in dumps:
        with pytest.raises(UnsafePickleError, match="refusing to load posix.system"):
            load_dump(dump)
    assert _snapshot(marker) == before


def test_a_dumps_own_dtype_state_never_reaches_numpys_canonical_dtype(tmp_path: Path) -> None:
    # numpy.dtype("f4", False, False) is numpy's shared float32: the unpickler always copies
    dump = tmp_path / "dtype.pkl"
    state = (P2 + MARK + b"K\x03" + _s(">") + NONE + NONE + NONE + b"J\xff\xff\xff\xff" * 2 + b"K\x00" + TUPLE)
    dump.write_bytes(P2 + _g("numpy", "dtype") + _s("f4") + b"\x89\x89" + TUPLE3 + REDUCE + state[2:] + BUILD + STOP)
    got = load_dump(dump)
    assert got.str == ">f4" and np.dtype("f4").str == "<f4"


def test_real_dumps_of_tensors_arrays_and_containers_still_load(tmp_path: Path) -> None:
    obj = {"t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)[:, 1:], "p": torch.nn.Parameter(torch.ones(2)),
           "i": torch.tensor([1, 2], dtype=torch.int64), "size": torch.Size([2, 3]), "dev": torch.device("cpu"),
           "dt": torch.float16, "a": np.arange(5, dtype=np.float32), "s": np.float64(2.5),
           "rec": np.zeros(2, dtype=[("x", "<i4"), ("y", ">f8")]), "od": collections.OrderedDict(a=1),
           "dd": collections.defaultdict(list, {"k": [1]}), "set": {1, 2}, "fs": frozenset({3}), "c": 1 + 2j,
           "sl": slice(1, 5, 2), "nested": [(1, "a", None, b"bytes", 1.5)]}
    for i, save in enumerate((torch.save, lambda o, p: p.write_bytes(pickle.dumps(o, protocol=2)),
                              lambda o, p: p.write_bytes(pickle.dumps(o, protocol=5)))):
        dump = tmp_path / f"real{i}.pt"
        save(obj if i == 0 else {k: v for k, v in obj.items() if not isinstance(v, torch.Tensor)}, dump)
        got = load_dump(dump)
        for k, v in (obj if i == 0 else got).items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(got[k], v) and got[k].dtype == v.dtype and type(got[k]) is type(v), k
            elif isinstance(v, np.ndarray):
                assert np.array_equal(got[k], v) and got[k].dtype == v.dtype, k
            else:
                assert got[k] == obj[k], k
