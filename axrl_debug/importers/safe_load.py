"""Load another framework's dumps (pickles: `torch.save` files or plain pickles) without running
code from them.

A pickle names the callables that rebuild its objects; unpickling calls them, and sets the state
(BUILD) of whatever object it holds. The restricted unpickler here resolves exactly the listed
(module, name) pairs — torch's tensor rebuild functions, numpy's array/dtype/scalar
reconstructors, plain containers as constructors (`_CALLABLE`); torch's dtypes and storage classes,
numpy's DTypes as values never called (`_VALUES`) — with no attribute traversal, and it polices
the opcodes themselves (the pure-Python unpickler): every call (REDUCE, NEWOBJ, INST/OBJ, and the
inner call of `_rebuild_from_type_v2`) must be a listed constructor, a tensor rebuild may not
attach backward hooks, and BUILD may only fill in an array, tensor, stub or the dump's own dtype
(`numpy.dtype` always copies), never a class or a shared object, nor set a dunder attribute.
Anything else is refused with `UnsafePickleError` naming it and the file, before it is called or
set. ``trust=True`` (the ``--trust-pickle`` option, for a file the user trusts) lifts the refusal.

Classes of packages the importers must not import are mapped to plain data instead
(``stubs``): a TensorDict (package ``tensordict``) becomes a dict of its tensors, an object of
AxisRL (whose package is also named ``axrl``: importing it would load *this* project) a dict of its
state — even with ``trust``.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import sys
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


#: the (module, name) pairs a restricted pickle may name — exactly these, no attribute traversal
#: (a dotted name is never resolved), each a constructor of plain data, tensors or arrays
_CALLABLE: frozenset[tuple[str, str]] = frozenset({
    ("collections", "OrderedDict"), ("collections", "defaultdict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("builtins", "list"), ("builtins", "dict"), ("builtins", "tuple"), ("builtins", "int"), ("builtins", "float"),
    ("builtins", "str"), ("builtins", "bytes"), ("builtins", "bytearray"), ("builtins", "bool"),
    ("_codecs", "encode"),   # bytes in protocol-2 pickles (numpy arrays): str → bytes, nothing else
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Size"), ("torch", "Tensor"), ("torch", "device"),
    ("torch.nn.parameter", "Parameter"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),   # protocol-5 arrays
})
#: names a pickle may hold as values but never call: torch's dtypes and storage classes (type tags
#: of the tensors' storages) and numpy's DType classes
_VALUES: frozenset[tuple[str, str]] = frozenset(
    {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    | {("torch", n) for n in dir(torch) if n.endswith("Storage") and isinstance(getattr(torch, n, None), type)}
    | {("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage")}
    | {("numpy.dtypes", n) for n in dir(getattr(np, "dtypes", None)) if n.endswith("DType")})
#: the rebuild functions whose argument at this index is the tensor's backward hooks (must be empty:
#: a hook is a callable the importing process would run)
_HOOKS_ARG = {"_rebuild_tensor_v2": 5, "_rebuild_tensor_v3": 5, "_rebuild_parameter": 2}
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
        raise UnsafePickleError(f"copyreg._reconstructor of {cls!r} refused")
    return cls()


def _dtype(*args: Any) -> np.dtype:
    """numpy.dtype as a pickle may call it: always a new dtype (copy=True), never numpy's shared
    canonical one, so a BUILD that follows sets the state of this dump's own dtype only."""
    if not 1 <= len(args) <= 3:
        raise UnsafePickleError(f"numpy.dtype called with {len(args)} arguments")
    return np.dtype(args[0], bool(args[1]) if len(args) > 1 else False, True)


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch._tensor._rebuild_from_type_v2 with its inner call policed like any other call: `func`
    one of the allowed rebuild functions, `new_type` torch.Tensor or Parameter, no dunder state."""
    if not (isinstance(new_type, type) and new_type in (torch.Tensor, torch.nn.Parameter)):
        raise UnsafePickleError(f"_rebuild_from_type_v2 to {new_type!r} refused (tensors only)")
    _check_call(func, tuple(args))
    _check_state(state, new_type)
    return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)


def _check_call(func: Any, args: tuple) -> None:
    """Refuse a call the restricted unpickler must not make: anything but an allowed constructor
    (or a stub), and tensor rebuilds that would attach backward hooks (callables run later)."""
    name = getattr(func, "__name__", "")
    allowed = id(func) in _callable_objects() or (isinstance(func, type) and issubclass(func, PlainState))
    if not allowed:
        raise UnsafePickleError(f"calling {func!r} refused: a dump may only call constructors of "
                                     "tensors, arrays and plain containers")
    at = _HOOKS_ARG.get(name) if getattr(func, "__module__", "") == "torch._utils" else None
    if at is not None and len(args) > at and args[at]:
        raise UnsafePickleError(f"{name} with backward hooks refused (a hook is code run later)")


def _check_state(state: Any, target: Any) -> None:
    """Refuse a state that would set a dunder attribute (``__class__``, ``__dict__``…)."""
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    for part in parts:
        if isinstance(part, dict) and any(not isinstance(k, str) or k.startswith("__") for k in part):
            raise UnsafePickleError(f"state of {type(target).__name__} setting {sorted(map(str, part))} refused")


def _check_build(inst: Any, state: Any) -> None:
    """BUILD (set an object's state) only on instances this dump made: arrays, tensors, stubs and
    its own (non-canonical) dtypes — never on a class, function, module or shared singleton."""
    if isinstance(inst, np.dtype):
        ok = inst.isbuiltin == 0            # this dump's copy, not numpy's canonical dtype
    else:
        ok = isinstance(inst, (np.ndarray, torch.Tensor, PlainState)) and not isinstance(inst, type)
    if not ok:
        raise UnsafePickleError(f"setting the state of {inst!r} refused: a dump may only fill in "
                                     "the arrays, tensors and containers it builds")
    _check_state(state, inst)


def _resolve(module: str, name: str) -> Any:
    """The object a listed (module, name) stands for (plain getattr on the imported module)."""
    if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
        return _rebuild_from_type
    if (module, name) == ("numpy", "dtype"):
        return _dtype
    __import__(module)
    return getattr(sys.modules[module], name)


_CALLABLE_OBJECTS: dict[int, Any] = {}   # id -> object, on first use: _CALLABLE's and numpy's DTypes


def _callable_objects() -> dict[int, Any]:
    """The objects a dump may call, by identity (never by ==: an array compares element-wise)."""
    if not _CALLABLE_OBJECTS:
        # numpy 2's numpy.core.* is a deprecated alias of numpy._core.* (same objects): not imported
        # here (it warns), only when a dump names it
        legacy = hasattr(np, "_core")
        found = [_resolve(m, n) for m, n in sorted(_CALLABLE)
                 if not (legacy and m.startswith("numpy.core.")) and _importable(m, n)]
        found += [_resolve(m, n) for m, n in sorted(_VALUES) if m == "numpy.dtypes"]
        _CALLABLE_OBJECTS.update({id(o): o for o in [*found, _reconstructor]})
    return _CALLABLE_OBJECTS


def _importable(module: str, name: str) -> bool:
    try:
        _resolve(module, name)
        return True
    except (ImportError, AttributeError):
        return False


class _Policed(pickle._Unpickler):  # type: ignore[name-defined]
    """The pure-Python unpickler with every call (REDUCE, NEWOBJ, INST/OBJ) and every BUILD
    checked: find_class alone cannot stop a dump from mutating an allowed class it names."""

    trusted = False
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not self.trusted:
            _check_call(func, tuple(args))
        self.stack[-1] = func(*args)
    dispatch[pickle.REDUCE[0]] = load_reduce

    def load_build(self) -> None:
        if not self.trusted:
            _check_build(self.stack[-2], self.stack[-1])
        super().load_build()
    dispatch[pickle.BUILD[0]] = load_build

    def load_newobj(self) -> None:
        if not self.trusted:
            _check_call(self.stack[-2], tuple(self.stack[-1]))
        super().load_newobj()
    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self) -> None:
        if not self.trusted:
            if self.stack[-1]:
                raise UnsafePickleError("NEWOBJ_EX with keyword arguments refused")
            _check_call(self.stack[-3], tuple(self.stack[-2]))
        super().load_newobj_ex()
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def _instantiate(self, klass: Any, args: list) -> None:
        if not self.trusted:
            _check_call(klass, tuple(args))
        super()._instantiate(klass, args)


def _unpickler_class(path: Path, trust: bool, stubs: tuple[str, ...]) -> type:
    """An Unpickler whose find_class resolves exactly the listed names for ``path`` (the stubs
    aside) and whose calls and BUILDs are policed (both lifted by ``trust``)."""

    class Restricted(_Policed):
        trusted = trust

        def find_class(self, module: str, name: str) -> Any:
            if any(module == s or module.startswith(s + ".") for s in stubs):
                return _stub(module, name)          # never imported, even when trusted
            if (module, name) == ("copyreg", "_reconstructor"):
                return _reconstructor
            if trust:
                return super().find_class(module, name)
            if self.proto < 3 and self.fix_imports:     # Python 2 names (`__builtin__.set`)
                module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
                module = _compat_pickle.IMPORT_MAPPING.get(module, module)
            if (module, name) in _CALLABLE or (module, name) in _VALUES:
                return _resolve(module, name)
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
    except UnsafePickleError as e:
        if str(e).startswith(f"{path}: "):
            raise
        raise UnsafePickleError(f"{path}: {e}. If you trust the file, pass --trust-pickle") from None
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

