"""Run a real SGLang server on a CPU-only machine — a CPU DEBUGGING AID, not a production path.

SGLang does not support CPU-only machines without its CPU kernel build. This module holds every
piece needed to serve small models with the stock PyPI wheel anyway, so that AxRL's SGLang client,
launcher, weight sync and routing replay (R3) can be tested against the real server on a laptop
or in CI. It is pinned to the SGLang versions it was tested with (`TESTED_VERSIONS`); on any other
version it refuses to run (set AXRL_SGLANG_CPU_COMPAT_ANY_VERSION=1 to try anyway).

Usage (inside the environment built by `scripts/sglang-cpu-env.sh DIR`)::

    DIR/bin/python axrl/inference/sglang/cpu_compat.py --model-path MODEL --port 30000 \\
        [--enable-return-routed-experts] [any sglang.launch_server flag]

What it does, all in-process (the installed SGLang files are never edited):
1. Import stand-ins for `sgl_kernel` (the CUDA kernel package, absent here) and `torchvision`
   (the PyPI build does not load beside a CPU torch, and text serving never calls it). A stand-in
   satisfies imports only; calling anything in it raises. With `--attention-backend
   torch_native` no kernel is called on the paths a text model uses.
2. The routed-experts host buffer: `mem_cache/pool_host/common.py`'s ALLOC_MEMORY_FUNCS table has
   no "cpu" entry and falls back to `cudaHostRegister`; a "cpu" entry allocating plain host
   memory is added.
3. SGLANG_USE_CPU_ENGINE=1, and CPU flags when the caller did not give them: --device cpu
   --attention-backend torch_native --sampling-backend pytorch --disable-overlap-schedule
   --max-total-tokens 4096 --skip-server-warmup.
4. Runs `sglang.launch_server`'s main with the resulting argv.

SGLang starts its scheduler and detokenizer with multiprocessing "spawn". A spawned child
re-imports the parent's main script (as `__mp_main__`) before it unpickles its target, so the
module-level `install()` below runs in every child too, before any SGLang code there.

This file must stay standalone: it runs in the SGLang virtual environment, where AxRL is not
installed. Imports: the standard library, and torch/sglang only inside functions.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
import types
from typing import Any, Callable, Sequence

TESTED_VERSIONS = ("0.5.23",)
# Modules that only have to import (SGLang imports torchvision unconditionally, through its
# multimodal configs). Submodules (sgl_kernel.flash_attn, torchvision.transforms…) are stand-ins
# too. A stand-in reports version STAND_IN_VERSION: transformers finds it with find_spec and then
# parses its version, and the oldest version makes every version-gated path the plain one.
STAND_IN_MODULES = ("sgl_kernel", "torchvision")
STAND_IN_VERSION = "0.0.0"
# Flags added when absent: (flag, value or None for a switch). Values chosen for tiny models.
DEFAULT_CPU_FLAGS: tuple[tuple[str, str | None], ...] = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--sampling-backend", "pytorch"),
    ("--disable-overlap-schedule", None),
    ("--max-total-tokens", "4096"),
    ("--skip-server-warmup", None),
)
ANY_VERSION_ENV = "AXRL_SGLANG_CPU_COMPAT_ANY_VERSION"


def check_version() -> str:
    """Return the installed SGLang version; exit with a clear message if it was never tested."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"cpu_compat: sglang is not installed in {sys.executable}'s environment; "
                 "build one with scripts/sglang-cpu-env.sh DIR and run DIR/bin/python")
    if version not in TESTED_VERSIONS and os.environ.get(ANY_VERSION_ENV) != "1":
        sys.exit(f"cpu_compat: sglang {version} is not a tested version ({', '.join(TESTED_VERSIONS)}); "
                 f"the CPU patches may not fit it. Install sglang=={TESTED_VERSIONS[-1]} "
                 f"(scripts/sglang-cpu-env.sh) or set {ANY_VERSION_ENV}=1 to try anyway")
    return version


class _StandInMeta(type):
    """Metaclass of stand-in attributes: any attribute is another stand-in, calling one raises.

    Stand-ins are classes (not instances) so that import-time uses such as subclassing or type
    annotations keep working; only an actual call fails, with a message naming what was called.
    """

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"cpu_compat: {cls.__qualname__} is an import stand-in on this CPU-only "
                           "machine; the code path that called it needs the real package (a GPU build)")


def _stand_in(qualname: str) -> type:
    return _StandInMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "cpu_compat"})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{self.__name__}.{name}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `STAND_IN_MODULES` (and their submodules) when nothing real can be imported.

    Placed last on sys.meta_path, so an installed package always wins.
    """

    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(roots)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", 1)[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []  # a package, so `import x.y` finds submodules through this finder
        module.__cpu_compat_stand_in__ = True
        module.__version__ = STAND_IN_VERSION
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _real_module_loads(name: str) -> bool:
    """True if `name` imports for real (torchvision can be installed and still fail)."""
    try:
        __import__(name)
        return True
    except Exception:  # noqa: BLE001 — any failure means the stand-in is needed
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]  # drop half-imported modules so the stand-in is found next
        return False


def install_stand_ins() -> list[str]:
    """Install import stand-ins for the modules in STAND_IN_MODULES that do not load; return them."""
    if any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        return [r for f in sys.meta_path if isinstance(f, _StandInFinder) for r in f.roots]
    missing = [name for name in STAND_IN_MODULES if not _real_module_loads(name)]
    if missing:
        sys.meta_path.append(_StandInFinder(missing))
    return missing


def _alloc_host_cpu(dims: tuple, dtype: Any, device: str, pin_memory: bool, allocator: Any,
                    registration_granularity_bytes: int | None = None) -> Any:
    """ALLOC_MEMORY_FUNCS entry for "cpu": plain host memory (no CUDA to pin or register with)."""
    import torch

    return torch.zeros(dims, dtype=dtype, device="cpu")


def patch_host_buffer_alloc() -> None:
    """Give the host-buffer allocation table a "cpu" entry (used by the routed-experts capturer)."""
    from sglang.srt.mem_cache.pool_host import common

    table = common.ALLOC_MEMORY_FUNCS  # a defaultdict whose default registers memory with CUDA
    if "cpu" not in table:
        table["cpu"] = _alloc_host_cpu


def install() -> None:
    """Apply every CPU patch to this process (idempotent). Call it before anything imports sglang:
    SGLang reads SGLANG_USE_CPU_ENGINE once and imports the stand-in modules at import time."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    install_stand_ins()
    patch_host_buffer_alloc()


def _has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def with_cpu_flags(argv: Sequence[str]) -> list[str]:
    """argv plus each DEFAULT_CPU_FLAGS entry the caller did not give."""
    out = list(argv)
    for flag, value in DEFAULT_CPU_FLAGS:
        if not _has_flag(out, flag):
            out += [flag] if value is None else [flag, value]
    return out


def main(argv: Sequence[str] | None = None, run: Callable[[Any], None] | None = None) -> None:
    """Check the version, patch, and run sglang.launch_server's main with the CPU flags added."""
    check_version()
    install()
    args = with_cpu_flags(sys.argv[1:] if argv is None else argv)
    print(f"cpu_compat: sglang.launch_server {' '.join(args)}", file=sys.stderr, flush=True)

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(args)
    try:
        (run or run_server)(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


# Module level on purpose: spawned SGLang children re-import this file as `__mp_main__` and
# must be patched before they unpickle (and so import) their SGLang target.
if __name__ in ("__main__", "__mp_main__"):
    check_version()
    install()

if __name__ == "__main__":
    main()
