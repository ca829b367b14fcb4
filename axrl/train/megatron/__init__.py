"""The Megatron-core train backend (optional: `pip install 'axrl[megatron]'`).

Importing this package does not import megatron-core; building a `MegatronBackend` does.
"""

from axrl.train.megatron.backend import (INSTALL_HINT, MegatronBackend, MegatronBackendConfig, check_parallel_fit,
                                         require_megatron)

__all__ = ["INSTALL_HINT", "MegatronBackend", "MegatronBackendConfig", "check_parallel_fit", "require_megatron"]
