"""Test hook for crash/resume tests: ``MEGAMU_CRASH_AFTER=kind:index`` ends the process abruptly (no cleanup, like a
kill) right after that point: ``shard:K`` (rollout shard K written), ``update:N`` (global update N done, after its
checkpoint if any), ``stage:S`` (stage S logged)."""

from __future__ import annotations

import os

CRASH_ENV = "MEGAMU_CRASH_AFTER"


def crash_point(kind: str, index: int) -> None:
    if os.environ.get(CRASH_ENV) == f"{kind}:{index}":
        os._exit(17)
