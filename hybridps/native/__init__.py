"""Optional native (C) row kernels; see fused_adam.c, row_optim.c (the Adagrad family and
partial-rowwise Adam) and hybridps.optim for the dispatch.

`ext` is the compiled module hybridps.native._fused_adam, or None when it was not built
(no C compiler at install time) or does not load; `load_error` then says why.
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
