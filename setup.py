"""Package metadata lives in pyproject.toml; this file only serves the optional ahead-of-time
build of the copy kernels.

By default kvtier installs as pure Python plus the kernel sources (`kvtier/kernels/csrc/`), and the
kernels are compiled on first use against whatever torch is installed (see
`kvtier/kernels/build.py`): `pip install kvtier` works with build isolation. To compile at
install time instead (e.g. for an image without a compiler at run time):

    KVTIER_BUILD_EXT=1 pip install --no-build-isolation .

which builds `kvtier._C` against the torch already installed (with CUDA when torch has CUDA
and a toolkit is found).
"""

from __future__ import annotations

import os
import sys

from setuptools import setup


def _aot_extension() -> dict[str, object]:
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        sys.exit("kvtier: KVTIER_BUILD_EXT=1 needs torch installed; use "
                 "`pip install --no-build-isolation`")
    sources = ["kvtier/kernels/csrc/kv_ops.cpp", "kvtier/kernels/csrc/kv_codec.cpp",
               "kvtier/kernels/csrc/kv_module.cpp"]
    flags = ["-O3", "-g0", "-fopenmp"]
    if torch.version.cuda is not None and CUDA_HOME is not None:
        ext = CUDAExtension("kvtier._C", [*sources, "kvtier/kernels/csrc/kv_ops_cuda.cu"],
                            define_macros=[("KVTIER_WITH_CUDA", None)],
                            extra_compile_args={"cxx": flags, "nvcc": ["-O3"]},
                            extra_link_args=["-fopenmp"])
    else:
        ext = CppExtension("kvtier._C", sources, extra_compile_args={"cxx": flags},
                           extra_link_args=["-fopenmp"])
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(**(_aot_extension() if os.environ.get("KVTIER_BUILD_EXT") == "1" else {}))
