"""The C kernels (``statefulset/index/kernels.c``) built into the wheel; everything else is in pyproject.toml.

``pip install .`` and ``pip install -e .`` (which runs ``build_ext`` in place) compile them once, at
install time, into ``statefulset/index/_kernels.<abi>.so``; a job then needs no compiler and loads
no code from a cache folder. Flags: the platform's release flags plus ``-ffp-contract=off`` (no
fused multiply-add; never fast-math), so that every double rounds exactly as in megatron-core's
``helpers.cpp`` and in the Python fallbacks. The library records the SHA-256 of the ``kernels.c``
it was built from, so that a checkout whose ``kernels.c`` changed since (an editable install not
rebuilt) is noticed at load time instead of running old code; likewise ``kernels_module.c``'s, for the
functions the module itself holds (the compiled metrics read). The extension is optional: without
a compiler the install still succeeds and ``statefulset.index.compiled`` falls back, with a WARNING.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "statefulset/index/kernels.c"
MODULE = "statefulset/index/kernels_module.c"
DIGEST = hashlib.sha256((Path(__file__).resolve().parent / KERNELS).read_bytes()).hexdigest()
# The module's own functions (the compiled metrics read) are checked against this file the same way.
MODULE_DIGEST = hashlib.sha256((Path(__file__).resolve().parent / MODULE).read_bytes()).hexdigest()


class BuildKernels(build_ext):
    """build_ext with the floating-point flags of the compiler at hand."""

    def build_extensions(self) -> None:
        strict = ["/fp:precise"] if self.compiler.compiler_type == "msvc" else ["-ffp-contract=off", "-fno-fast-math"]
        for extension in self.extensions:
            extension.extra_compile_args = [*extension.extra_compile_args, *strict]
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "statefulset.index._kernels",
            sources=[KERNELS, MODULE],
            define_macros=[("SF_SOURCE_SHA256", f'"{DIGEST}"'), ("SF_MODULE_SHA256", f'"{MODULE_DIGEST}"')],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildKernels},
)
