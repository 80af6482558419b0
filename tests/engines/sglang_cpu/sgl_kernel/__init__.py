"""Test-only stand-in for the `sgl_kernel` package, for tests/engines/sglang_e2e_test.py on a CPU-only host.

Replaces: the real package's __init__, which loads its compiled ops (common_ops) and fails on a
host without libcuda.so.1 (PyPI's sgl-kernel is built for CUDA only). SGLang imports names from
it at module level even where its CPU path never calls them.
What still runs for real: the package's pure-Python submodules (`import sgl_kernel.X` loads the
real sgl_kernel/X.py from the installed package's directory, which __path__ names), and its
`scalar_types`. Every other name is a stub that raises NotImplementedError naming itself when
called: a code path that needs a real kernel fails loudly instead of computing something else.
"""

import importlib
import importlib.machinery
import os
import sys

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The installed package's directory: the first sgl_kernel on the path that is not this one.
_real = importlib.machinery.PathFinder.find_spec(
    "sgl_kernel", [p for p in sys.path if os.path.abspath(p or ".") != _HERE])
if _real is None or not _real.submodule_search_locations:
    raise ImportError("sgl_kernel stand-in: the installed sgl-kernel package is not on the path")
__path__ = list(_real.submodule_search_locations)
__version__ = "0.0.0+kvstash-test-stand-in"


def _stub(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in (tests/engines/sglang_cpu): {name} needs the real kernel")

    stub.__name__ = stub.__qualname__ = name
    return stub


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name in ("scalar_types", "ScalarType"):  # plain Python in the real package
        return getattr(importlib.import_module("sgl_kernel.scalar_type"), name)
    return _stub(name)
