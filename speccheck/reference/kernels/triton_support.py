"""What the engine's Triton kernels (gdn_fused, dflash2_fused) share: whether Triton can run
here, and each kernel defined once on first use.

Both are plain module-level dicts, not ``functools`` caches, so that a step traced by
``torch.compile`` (engine arg ``compile``) reads the answer and the kernel instead of tracing
an import or a decorator."""
from __future__ import annotations

import os

_MISSING: dict = {}  # device type -> why Triton cannot run there (None: it can)
_KERNELS: dict = {}  # name -> what its define() returned


def interpreted() -> bool:
    """``TRITON_INTERPRET=1``: the kernels run on CPU tensors through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_missing(device_type: str) -> str | None:
    """Why a Triton kernel cannot run on this device type (None: it can)."""
    if device_type not in _MISSING:
        if device_type != "cuda" and not interpreted():
            _MISSING[device_type] = f"a Triton kernel for CUDA; this engine runs on {device_type}"
        else:
            try:
                import triton  # noqa: F401
                _MISSING[device_type] = None
            except ImportError:
                _MISSING[device_type] = ("a Triton kernel, and Triton is not installed "
                                         "(pip install triton)")
    return _MISSING[device_type]


def unavailable(device_type: str, form: str) -> str | None:
    """Why ``form`` (a kernel form of the engine, e.g. "GDN form fused") cannot run on this
    device type (None: it can)."""
    why = triton_missing(device_type)
    return why and f"{form} is {why}"


def kernel(name: str, define):
    """``define()`` (which builds the ``@triton.jit`` kernels) once per process."""
    if name not in _KERNELS:
        if interpreted():
            _interpreter_loop_bounds()
        _KERNELS[name] = define()
    return _KERNELS[name]


def _interpreter_loop_bounds() -> None:
    """Triton's interpreter holds a scalar as a 1-element array and turns a loop bound read
    from memory (``range(0, n)``) into a Python int with ``int(array)``, which NumPy 2
    refuses for a 1-d array; this reads its one element instead (the compiled kernel is
    unaffected: it is the interpreter's own patch of ``tensor.__index__``)."""
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_speccheck_index", False):
        return
    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._speccheck_index = True
