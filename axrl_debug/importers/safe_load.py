"""Load another framework's dumps (pickles: `torch.save` files or plain pickles) without running
code from them.

A pickle names the callables that rebuild its objects; unpickling calls them. The restricted
unpickler here resolves only an allowlist — torch's tensor/storage rebuild functions, numpy's
array/dtype/scalar reconstructors, plain containers — and refuses anything else with
`UnsafePickleError` naming the class and the file, before calling it. ``trust=True`` (the
``--trust-pickle`` option, for a file the user trusts) lifts the refusal.

Classes of packages the importers must not import are mapped to plain data instead
(``stubs``): a TensorDict (package ``tensordict``) becomes a dict of its tensors, an object of
AxisRL (whose package is also named ``axrl``: importing it would load *this* project) a dict of its
state — even with ``trust``.
"""

from __future__ import annotations

import io
import pickle
import types
import zipfile
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

__all__ = ["ImportFormatError", "UnsafePickleError", "load_dump", "as_numpy"]


class ImportFormatError(ValueError):
    """A dump lacks a field or has one of the wrong shape; the message names the file and the field."""


class UnsafePickleError(ImportFormatError):
    """A dump references a class outside the allowlist; the message names the class and the file."""


_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    ("collections", "OrderedDict"), ("collections", "defaultdict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("_codecs", "encode"),   # bytes in protocol-2 pickles (numpy arrays): str → bytes, nothing else
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Size"), ("torch", "Tensor"), ("torch", "device"),
    ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
})
DEFAULT_STUBS = ("tensordict",)


class PlainState(dict):
    """What a stubbed class becomes: a dict of its pickled state. A TensorDict's state holds its
    tensors under ``_tensordict``; those (nested TensorDicts included) are the dict's items, and a
    non-tensor entry (``NonTensorData``, set with ``set_non_tensor``) becomes its plain value."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        # tensordict >= 0.6 pickles a TensorDict as ``_make_td(cls, state)``: the stub of
        # ``_make_td`` is called with (stub class, state dict) and stands for that TensorDict.
        if len(args) == 2 and not kwargs and isinstance(args[0], type) and isinstance(args[1], dict):
            self.__setstate__(args[1])
        elif args or kwargs:                          # any other stub called with arguments keeps them
            self["__args__"] = list(args)
            self.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}        # (__dict__, __slots__ values)
        if isinstance(state, dict) and isinstance(state.get("_tensordict"), dict):
            state = {k: _non_tensor_value(v) for k, v in state["_tensordict"].items()}
        if isinstance(state, dict):
            self.update(state)
        else:
            self["__state__"] = state


def _non_tensor_value(value: Any) -> Any:
    """A ``NonTensorData`` entry's value (its state keeps it under ``non_tensordict["data"]``);
    anything else unchanged."""
    inner = value.get("non_tensordict") if isinstance(value, PlainState) else None
    if isinstance(inner, dict) and inner.get("_is_non_tensor") and "data" in inner:
        return inner["data"]
    return value


def _stub(module: str, name: str) -> type:
    """A PlainState subclass standing for ``module.name`` (kept in its name for messages)."""
    return type(name, (PlainState,), {"__module__": f"stub:{module}"})


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """copyreg._reconstructor (protocol 0/1 pickles of plain objects), for stub classes only."""
    if not (isinstance(cls, type) and issubclass(cls, PlainState)):
        raise pickle.UnpicklingError(f"copyreg._reconstructor of {cls!r} refused")
    return cls()


def _is_storage_or_dtype(module: str, name: str) -> bool:
    """torch's storage classes and dtypes (``torch.float32`` is pickled by name)."""
    if module != "torch":
        return False
    return name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype)


def _unpickler_class(path: Path, trust: bool, stubs: tuple[str, ...]) -> type:
    """An Unpickler whose find_class applies the allowlist for ``path``."""

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if any(module == s or module.startswith(s + ".") for s in stubs):
                return _stub(module, name)          # never imported, even when trusted
            if (module, name) == ("copyreg", "_reconstructor"):
                return _reconstructor
            if (module, name) in _ALLOWED or _is_storage_or_dtype(module, name):
                return super().find_class(module, name)
            if module.startswith("numpy.dtypes") and name.endswith("DType"):
                return super().find_class(module, name)
            if trust:
                return super().find_class(module, name)
            raise UnsafePickleError(
                f"{path}: refusing to load {module}.{name}: a dump may only hold tensors, arrays and plain "
                "containers (its unpickling would call this class/function). If you trust the file, pass "
                "--trust-pickle")

    return Restricted


def load_dump(path: str | Path, *, trust: bool = False, stubs: Iterable[str] = DEFAULT_STUBS) -> Any:
    """The object stored in ``path`` (a ``torch.save`` file or a plain pickle), tensors on the CPU,
    through the restricted unpickler. Raises UnsafePickleError / ImportFormatError."""
    path = Path(path)
    cls = _unpickler_class(path, trust, tuple(stubs))
    module = types.ModuleType("axrl_restricted_pickle")
    module.Unpickler = cls                                       # torch.load subclasses it
    module.load = lambda f, **kw: cls(f, **kw).load()            # the legacy format's header records
    try:
        if zipfile.is_zipfile(path):
            return torch.load(path, map_location="cpu", pickle_module=module, weights_only=False)
        with open(path, "rb") as fh:
            head = fh.read()
        try:
            return torch.load(io.BytesIO(head), map_location="cpu", pickle_module=module, weights_only=False)
        except UnsafePickleError:
            raise
        except Exception:   # not torch's legacy format: a plain pickle
            return cls(io.BytesIO(head)).load()
    except UnsafePickleError:
        raise
    except FileNotFoundError:
        raise
    except Exception as e:
        raise ImportFormatError(f"{path}: cannot read it as a torch.save file or a pickle "
                                f"({type(e).__name__}: {e})") from None


def as_numpy(value: Any, where: str) -> np.ndarray:
    """A tensor / array / list as a numpy array (bf16 tensors as float32)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ImportFormatError(f"{where}: not an array ({e})") from None

