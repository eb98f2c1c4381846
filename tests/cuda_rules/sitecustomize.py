"""Every Python a test starts enforces CUDA's tensor rules on CPU (see cuda_rules.py), once it imports torch."""
import importlib.abc
import sys


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Installs the rules right after ``import torch`` finishes, so a process that never imports torch pays nothing."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:  # a Python without torch: nothing to enforce
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            import cuda_rules

            cuda_rules.install()

        loader.exec_module = exec_then_install
        return spec


import importlib.util  # noqa: E402

sys.meta_path.insert(0, _AfterTorch())
