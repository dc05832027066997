"""Build hook for the optional native kernels: the row kernels (hybridps/native/fused_adam.c,
row_optim.c; with them the dynamic tables' id map and initial rows, dynamic.c, and the
page file's CRC-32C and page check, page_check.c) and the
owner's pooled-bags kernel (hybridps/native/pooled_bags.c).

All project metadata lives in pyproject.toml; this file only declares the C
extensions, which are optional: without a working C compiler `pip install` still
succeeds and hybridps.optim and hybridps.pooled_bags use their torch paths. Each compiler
flag is probed with the actual compiler and kept only if it works. No OpenMP: the row
kernels run on their own small pthread pool (see the comment at the top of fused_adam.c
for why); the pooled-bags kernel is single-threaded.
"""

from __future__ import annotations

import os
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -ffp-contract=off: no fused multiply-add contraction, so float32 results stay those
# of torch's separate ops; -fno-math-errno lets sqrtf vectorize. Never -ffast-math.
# Portable ISA baseline on purpose (no -march=native): the loops are memory-bound.
UNIX_CFLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-pthread"]
UNIX_LDFLAGS = ["-pthread", "-lm"]
# Function multiversioning (an extra AVX2+FMA build of the loops, chosen at load time).
CLONES_PROBE = """
__attribute__((target_clones("avx2", "default")))
static void twice(float *x, int n) { for (int i = 0; i < n; i++) x[i] *= 2.0f; }
void (*probe_fn)(float *, int) = twice;
"""


class BuildExt(build_ext):
    def _compiles(
        self, flags: list[str], link: bool, code: str = "int probe(void) { return 0; }\n"
    ) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.c")
            with open(src, "w") as f:
                f.write(code)
            try:
                objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=flags)
                if link:
                    self.compiler.link_shared_object(
                        objs, os.path.join(tmp, "probe.so"), extra_postargs=flags
                    )
            except Exception:
                return False
        return True

    def build_extensions(self) -> None:
        if self.compiler.compiler_type == "unix":
            cflags = [f for f in UNIX_CFLAGS if self._compiles([f], link=False)]
            ldflags = [f for f in UNIX_LDFLAGS if self._compiles([f], link=True)]
            if self._compiles([*cflags, "-Werror"], link=True, code=CLONES_PROBE):
                cflags.append("-DHYBRIDPS_TARGET_CLONES")
        elif self.compiler.compiler_type == "msvc":
            cflags, ldflags = ["/O2", "/fp:precise"], []
        else:
            cflags, ldflags = [], []
        for ext in self.extensions:
            ext.extra_compile_args = [*cflags, *ext.extra_compile_args]
            ext.extra_link_args = [*ldflags, *ext.extra_link_args]
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "hybridps.native._fused_adam",
            sources=["hybridps/native/fused_adam.c", "hybridps/native/row_optim.c",
                     "hybridps/native/dynamic.c", "hybridps/native/dynamic_step.c",
                     "hybridps/native/page_check.c"],
            depends=["hybridps/native/kernels.h", "hybridps/native/id_map.h",
                     "hybridps/native/dynamic.h"],
            optional=True,  # no compiler: install anyway, hybridps.optim falls back to torch
        ),
        Extension(
            "hybridps.native._pooled_bags",
            sources=["hybridps/native/pooled_bags.c"],
            depends=["hybridps/native/kernels.h"],
            optional=True,  # no compiler: hybridps.pooled_bags falls back to torch
        ),
    ],
    cmdclass={"build_ext": BuildExt},
)
