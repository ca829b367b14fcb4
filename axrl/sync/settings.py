"""`SyncSettings`: the sync sentinel's settings — the YAML section `sync` is this type
(docs/config.md, docs/debugging.md "Sync sentinel"). Light (pydantic only): the config reads it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from axrl.core.settings import Section

__all__ = ["SyncSettings", "VerifyMode", "OnFailure"]

VerifyMode = Literal["checksum", "probe", "both", "off"]
OnFailure = Literal["warn", "stop", "resync"]


class SyncSettings(Section):
    """What is verified after every weight sync and every resume, before the engine serves a
    token under the new version (`axrl.sync.verify.SyncSentinel`), and what a failure does."""

    verify: VerifyMode = Field("both", description="checksum: per-tensor checksums of the trainer's posted weights "
                               "vs the engine's; probe: `probe` earlier samples re-scored by engine and trainer "
                               "against the calibrated floor; both: checksums, and the probe where they cannot settle it (to calibrate, "
                               "after a failure, on engines without checksums); off")
    on_failure: OnFailure = Field("warn", description="warn: record a `sync_mismatch` event and go on; stop: fail "
                                  "the run naming the tensors / probe tokens; resync: send the weights again and "
                                  "verify again (then as warn)")
    probe: int = Field(2, ge=1, le=64, description="sequences of the run's own first samples re-scored at each "
                       "verification (verify: probe | both)")

    @field_validator("verify", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false: `verify: off` means what it says
        return "off" if v is False else v
