"""A pytest plugin for GPU machines without SGLang's CUDA kernel packages (`-p sglang_gpu_shim`):
stand-ins for `IPython.display` (imported by sglang/utils.py) and for every `sgl_kernel.<sub>`
module but `sgl_kernel.scalar_type` (which must fail to import so that SGLang takes its
fallback); `sgl_kernel` itself is kvtier's CPU stand-in. Enough for SGLang 0.5.23's pool
classes on CUDA; a kernel actually called raises NotImplementedError."""
import importlib.abc
import importlib.machinery
import sys
import types

ip = types.ModuleType("IPython")
disp = types.ModuleType("IPython.display")
disp.HTML = lambda *a, **k: None
disp.display = lambda *a, **k: None
ip.display = disp
sys.modules.setdefault("IPython", ip)
sys.modules.setdefault("IPython.display", disp)


class _Missing(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*a, **k):
            raise NotImplementedError(f"{self.__name__}.{name} stand-in")
        return kernel


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("sgl_kernel.") and name != "sgl_kernel.scalar_type":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name == "sgl_kernel.scalar_type":
            raise ImportError(name)
        return None

    def create_module(self, spec):
        m = _Missing(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
