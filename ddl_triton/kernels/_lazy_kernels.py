"""Where Triton is imported: the ``@triton.jit`` kernels load on first use, not with their launchers.

Every rank process imports the launchers (the communicator reduces with reduce.py, the compressed
collectives call int8.py and onebit.py), but on a CPU they run torch ops and never launch a Triton
kernel; importing triton costs ~0.3 s of a rank's ~2.8 s start. So each launcher module keeps its
``@triton.jit`` kernels in a private module beside it (reduce.py: _reduce_jit.py; int8.py:
_int8_jit.py; int4.py: _int4_jit.py; onebit.py: _onebit_jit.py; pack.py: _pack_jit.py), and that module, with triton, is
imported the first time a kernel is asked for: a launch on a CUDA tensor, or under
``DDL_KERNELS=triton`` (``Options.kernels="triton"``) with ``TRITON_INTERPRET=1``, or a reading of
the attribute (``reduce._reduce_kernel``). launch_configs.py imports triton inside the functions
that build a ``triton.Config`` or an autotuner; config_sweep.py, which times the compiled kernels, imports
triton and the private modules itself, and is loaded on first access (``ddl_triton.kernels.config_sweep``).
No other module of the package imports triton.

A launcher module declares its kernels once, and launches them through the declaration::

    _KERNELS = LazyKernels(__name__, "._reduce_jit", ["_reduce_kernel"])
    __getattr__ = _KERNELS.module_getattr     # PEP 562: reduce._reduce_kernel loads on first access
    ...
    _KERNELS["_reduce_kernel"][grid](...)     # the module's attribute, loading it if need be

A kernel is looked up as an attribute of the launcher module at every launch, so what is launched
is what ``reduce._reduce_kernel`` is now: the jit function once loaded, or whatever replaced it
there (a test's spy, set with monkeypatch).

Under ``TRITON_INTERPRET=1`` launches through ``_KERNELS[...]`` run one at a time, process-wide:
the interpreter patches ``triton.language`` while a kernel runs, so two threads interpreting at
once (a communicator's background thread dequantizing one bucket's gathered int8 while the
training thread quantizes the next: ddl_triton/runtime/compression/gathered.py) fail with "Did you forget to
add @triton.jit ?". Compiled kernels launch as they are.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from collections.abc import Iterable

from ._dispatch import interpreting

_INTERPRETER_LOCK = threading.Lock()  # one interpreted kernel at a time (module doc)


def load_triton(if_installed: bool = False) -> None:
    """Import triton now, as every first kernel load does; refuse where the process would abort.

    Triton and TensorFlow each bundle an LLVM that registers the same command-line options; whichever
    loads second finds them taken, and when that is triton the process dies on the spot ("LLVM ERROR:
    inconsistency in registered CommandLine options", SIGABRT), while triton first, TensorFlow second
    works. So once TensorFlow is loaded and triton is not, this raises ImportError naming the fix
    instead of letting a collective kill the rank; ``ddl_triton.tensorflow`` calls it before it imports
    TensorFlow, so its users never meet the error.

    Triton is not a dependency of the default install: a CPU rank never needs it, and CUDA builds
    of torch bring it. Where it is missing, this raises ImportError naming what asked for a kernel
    and the package to install; with ``if_installed`` it returns instead (there is then nothing to
    load before TensorFlow, and no kernel to clash with it)."""
    if sys.modules.get("triton") is not None:
        return
    if importlib.util.find_spec("triton") is None:  # looked up, not imported
        if if_installed:
            return
        raise ImportError("ddl_triton needs a Triton kernel (a collective on a CUDA tensor, or DDL_KERNELS=triton), "
                          "but triton is not installed: pip install triton (CUDA builds of torch bring it), "
                          "or pip install 'ddl_triton[triton]'")
    if "tensorflow" in sys.modules:
        raise ImportError("ddl_triton needs a Triton kernel, but TensorFlow was imported before Triton, and "
                          "Triton loaded after TensorFlow aborts the process (their LLVMs clash): import "
                          "ddl_triton.tensorflow (or call ddl_triton.kernels.load_triton()) before tensorflow")
    import triton  # noqa: F401


class LazyKernels:
    """The ``@triton.jit`` kernels ``names`` of launcher module ``module``, defined in ``source``
    (a module name relative to the launcher's package) and imported from there on first use."""

    def __init__(self, module: str, source: str, names: Iterable[str]):
        self._module = module
        self._source = source
        self._names = frozenset(names)

    def module_getattr(self, name: str):
        """The launcher module's ``__getattr__``: Python calls it only for a name the module lacks,
        so for a kernel only until the first load. Loading sets every kernel of ``source`` that the
        module does not have yet as a module attribute; other names raise AttributeError."""
        if name not in self._names:
            raise AttributeError(f"module {self._module!r} has no attribute {name!r}")
        module = sys.modules[self._module]
        load_triton()
        jit = importlib.import_module(self._source, module.__package__)
        for kernel in self._names:
            if kernel not in vars(module):  # keep one set on the module already (a spy)
                setattr(module, kernel, getattr(jit, kernel))
        return vars(module)[name]

    def __getitem__(self, name: str):
        """The kernel ``name`` as the launcher module holds it now, loaded if need be."""
        if name not in self._names:
            raise KeyError(f"{self._module}: {name!r} is not one of its Triton kernels {sorted(self._names)}")
        kernel = getattr(sys.modules[self._module], name)
        return _OneAtATime(kernel) if interpreting() else kernel


class _OneAtATime:
    """``kernel[grid](...)`` under the interpreter's lock (module doc)."""

    __slots__ = ("_kernel",)

    def __init__(self, kernel):
        self._kernel = kernel

    def __getitem__(self, grid):
        launch = self._kernel[grid]

        def locked(*args, **kwargs):
            with _INTERPRETER_LOCK:
                return launch(*args, **kwargs)
        return locked

    def __getattr__(self, name: str):  # the kernel's other attributes (fn, arg_names, ...)
        return getattr(self._kernel, name)


def cdiv(n: int, d: int) -> int:
    """``ceil(n / d)`` for positive ints: ``triton.cdiv``, for launch grids, without importing triton."""
    return (n + d - 1) // d
