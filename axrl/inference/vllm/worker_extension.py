"""The one worker extension AxRL loads into the vLLM servers it launches (vLLM takes one
`--worker-extension-cls`): bisect's forward capture (`probe_extension`) and the sync sentinel's
checksums (`checksum_extension`), both called through `POST /collective_rpc` (dev mode).

Like its parts, it imports nothing from vLLM or AxRL at import time.
"""

from __future__ import annotations

from axrl.inference.vllm.checksum_extension import ChecksumExtension
from axrl.inference.vllm.probe_extension import ProbeExtension

EXTENSION = "axrl.inference.vllm.worker_extension.WorkerExtension"


class WorkerExtension(ProbeExtension, ChecksumExtension):
    """Mixed into vLLM's worker class."""
