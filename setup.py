"""Builds the `kvtier._C` kernels; all package metadata lives in pyproject.toml.

The extension is compiled against the torch that is already installed, so install with
`pip install --no-build-isolation ...` (an isolated build would fetch a second torch). The CUDA
kernels are added only when torch itself was built with CUDA and a CUDA toolkit is found.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - only reached with build isolation
    sys.exit("kvtier: building kvtier._C needs torch; use `pip install --no-build-isolation`")

SOURCES = ["csrc/kv_ops.cpp"]
DEPENDS = ["csrc/kv_ops.h"]
# at::parallel_for is header-only: without OpenMP it silently runs on one thread. The extension
# then links libgomp.so.1, which resolves to the copy torch has already loaded.
CXX_FLAGS = ["-O3", "-g0", "-fopenmp"]


def _extension() -> Extension:
    # A CPU-only torch cannot load CUDA kernels even when a toolkit is installed (as here).
    if torch.version.cuda is not None and CUDA_HOME is not None:
        return CUDAExtension(
            "kvtier._C",
            [*SOURCES, "csrc/kv_ops_cuda.cu"],
            depends=DEPENDS,
            define_macros=[("KVTIER_WITH_CUDA", None)],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension(
        "kvtier._C",
        SOURCES,
        depends=DEPENDS,
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=["-fopenmp"],
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
)
