"""Optional native (C) row kernels; see fused_adam.c, row_optim.c (the Adagrad family and
partial-rowwise Adam) and hybridps.optim for the dispatch; dynamic.c for the dynamic
tables' per-id work.

`ext` is the compiled module hybridps.native._fused_adam, or None when it was not built
(no C compiler at install time) or does not load; `load_error` then says why. `dynamic`
is the same module where it has dynamic.c's functions (None otherwise: the callers take
their numpy/torch reference paths).
"""

from __future__ import annotations

import importlib
from types import ModuleType

ext: ModuleType | None
load_error: str | None
try:
    ext = importlib.import_module("hybridps.native._fused_adam")
    load_error = None
except ImportError as e:  # not built, or built for another interpreter
    ext = None
    load_error = f"{type(e).__name__}: {e}"

dynamic: ModuleType | None = ext if ext is not None and hasattr(ext, "idmap_find") else None
