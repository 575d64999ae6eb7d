"""Tests of file permissions that hold for root too: a child process started with
`preexec_fn=as_a_plain_user()` has lost root's right to read and write whatever the permissions say."""
from __future__ import annotations

import ctypes
from collections.abc import Callable

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2  # linux/prctl.h, linux/capability.h


def as_a_plain_user() -> Callable[[], None]:
    """A pre-exec hook that drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set,
    which the exec then takes from the child's effective capabilities."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def drop() -> None:
        for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
    return drop
