"""Optional native (C) row kernels; see fused_adam.c, row_optim.c (the Adagrad family and
partial-rowwise Adam) and hybridps.optim for the dispatch; dynamic.c for the dynamic
tables' per-id work and dynamic_step.c for a dynamic table's fused step.

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

# every function of dynamic.c and dynamic_step.c, or none (an older
# build: the fallbacks)
DYNAMIC_FUNCTIONS = ("idmap_find", "idmap_place", "idmap_remove", "idmap_rehash", "initial_rows",
                     "victims", "first_seen_unique", "serve_step", "lru_compact")
dynamic: ModuleType | None = ext if ext is not None and all(
    hasattr(ext, f) for f in DYNAMIC_FUNCTIONS) else None
