"""Every patch megatron-core needs to run on a CPU-only torch — in this one module.

Megatron-core is written for CUDA. On a machine without a CUDA device (debugging, CI) the
obstacles below stop it; each patch was seen failing and then working on the pinned versions
(docs/engine-facts.md, "Megatron-core on CPU with gloo"):

1. `torch.cuda.current_device()` is used as the device of ~175 allocations (attention buffers,
   router, rotary, TP collectives) → it returns "cpu".
2. The CUDA RNG tracker (forked by attention and the parallel linears even at dropout 0) reads
   and writes CUDA generator state → it tracks CPU generator states instead, restoring the
   global CPU generator afterwards so forking never perturbs the run's RNG stream.
3. `te_general_gemm` is referenced by the MoE router without Transformer Engine (0.16.1 bug:
   a NameError) → defined as None, so the router takes its plain matmul path.
4. The alltoall token dispatcher creates a `torch.cuda.Stream` and copies device→host on it →
   no stream; the copies run inline (everything is already on the host). Its split sizes become
   numpy arrays only when copied from a GPU; host tensors stayed tensors, which
   `all_to_all_single` rejects → converted as on GPU.
5. The parallel linears' autograd functions declare CUDA-only autocast (`custom_fwd` for
   device "cuda"), so under CPU autocast (dtype=bfloat16) their backward multiplies a bf16
   gradient by an fp32 weight and fails → re-declared for the CPU autocast.
6. Megatron's torch-norm wrapper refuses sequence parallelism → allowed; the backend all-reduces
   the norm gradients over the TP group itself (`rank.py`), as Megatron's finalize step would.

Not patched but needed by the caller: an explicit causal mask (Megatron builds the default one
on "cuda"), `use_cpu_initialization=True`, `torch.optim` optimizers (Megatron's own hard-code
CUDA), expert tensor parallel 1 (gloo's all-gather cannot take uneven token counts). On a CUDA
device `apply()` patches only 3 (the NameError is megatron-core's bug without Transformer Engine on
any device: seen on an H200 with torch 2.11); GPU runs otherwise use stock megatron-core.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

#: megatron-core versions these patches were tested against. Another version fails in `apply()`
#: with a message, rather than half-working: the patched internals move between releases.
TESTED_VERSIONS = ("0.16.1",)

_applied = False


def megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def needed() -> bool:
    """Whether this process needs the CPU patches (no usable CUDA device)."""
    return not torch.cuda.is_available()


def apply() -> bool:
    """Patch megatron-core for CPU use when no CUDA device is present (idempotent); on a CUDA
    device only the router's missing-Transformer-Engine bug (3) is mended.

    Returns True when the patches are (now) active. Raises RuntimeError on an untested
    megatron-core version, naming the tested ones.
    """
    global _applied
    if _applied:
        return True
    _patch_router_gemm()
    if not needed():
        return False
    version = megatron_version()
    if version not in TESTED_VERSIONS:
        raise RuntimeError(
            f"axrl's CPU support for megatron-core was tested with {', '.join(TESTED_VERSIONS)}, "
            f"but {version} is installed; install a tested one (pip install 'axrl[megatron]') or "
            f"run on a CUDA machine, where no patches are applied")
    _patch_current_device()
    _patch_rng_tracker()
    _patch_router_gemm()
    _patch_alltoall_stream()
    _patch_linear_autocast()
    _patch_torch_norm_sequence_parallel()
    _applied = True
    return True


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def add(self: Any, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self: Any, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork


def _patch_router_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_alltoall_stream() -> None:
    from megatron.core.transformer.moe import token_dispatcher as td

    class _HostStream:
        """Stands in for the device→host copy stream and its event: host copies are synchronous.
        It is also the "current stream", so the dispatcher never thinks it is on a side stream."""

        def wait_stream(self, other: Any) -> None:
            pass

        def record_event(self) -> "_HostStream":
            return self

        def synchronize(self) -> None:
            pass

    original_move = td.maybe_move_tensor_to_cpu

    def move_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        # On CUDA this turns split sizes into numpy arrays, which all_to_all_single takes; for a
        # tensor already on the host it returned the tensor, which all_to_all_single rejects.
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    td.maybe_move_tensor_to_cpu = move_to_host
    stream = _HostStream()
    td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    # torch.cuda has no streams without CUDA; these two calls are what the dispatcher makes.
    torch.cuda.current_stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.stream = lambda s: contextlib.nullcontext()  # type: ignore[assignment]


def _patch_linear_autocast() -> None:
    import inspect

    from megatron.core.tensor_parallel import layers

    for cls in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
        fwd = inspect.unwrap(cls.__dict__["forward"].__func__)   # drop the CUDA-autocast wrapper
        bwd = inspect.unwrap(cls.__dict__["backward"].__func__)
        cls.forward = staticmethod(torch.amp.custom_fwd(fwd, device_type="cpu"))
        cls.backward = staticmethod(torch.amp.custom_bwd(bwd, device_type="cpu"))


def _patch_torch_norm_sequence_parallel() -> None:
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls: Any, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, **kwargs)
        config.sequence_parallel = False  # only for the wrapper's assertion
        try:
            norm = original(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = True
        for p in norm.parameters():
            p.sequence_parallel = True  # Megatron's marker for grads that need a TP all-reduce
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new
