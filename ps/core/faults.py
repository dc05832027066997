"""The shard server's fault points for tests (as the worker's worker/runtime/faults.py):
each is read from one HYBRIDPS_PS_FAULT_* variable at its point and does nothing unset."""

from __future__ import annotations

import os
import time

from hybridps.errors import InvalidArgument

WRITE_FAULT_ENV = "HYBRIDPS_PS_FAULT_CHECKPOINT_WRITE"


def write_fault(step: int) -> None:
    """HYBRIDPS_PS_FAULT_CHECKPOINT_WRITE=STEP:sleep=SEC or STEP:fail: the write of the
    server's checkpoint of STEP sleeps SEC seconds, or fails (OSError), after each file
    (a slow or failing disk, or a window to kill the server in). Read at every file."""
    text = os.environ.get(WRITE_FAULT_ENV, "")
    if not text:
        return
    at, _, action = text.partition(":")
    try:
        fault_step = int(at)
        seconds = float(action.removeprefix("sleep=")) if action.startswith("sleep=") else 0.0
    except ValueError:
        raise InvalidArgument(f"{WRITE_FAULT_ENV}={text!r}: expected STEP:sleep=SEC or "
                              "STEP:fail") from None
    if action != "fail" and not action.startswith("sleep="):
        raise InvalidArgument(f"{WRITE_FAULT_ENV}={text!r}: expected STEP:sleep=SEC or "
                              "STEP:fail")
    if fault_step != step:
        return
    if action == "fail":
        raise OSError(f"injected checkpoint write failure at step {step} ({WRITE_FAULT_ENV})")
    time.sleep(seconds)
