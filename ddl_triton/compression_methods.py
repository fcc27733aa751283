"""The compression methods: one table, one row per method, by registry name (as ``schedules`` is for
algorithms). Every place that offers, runs, sizes, times or models a compressed allreduce reads it.

A row (:class:`Method`) says everything the rest of the package needs to know of a method:

    name            what ``Options.compression``, ``HookState(compression=...)``, ``compress_hook``,
                    per-level compression and ``ddl-simulate --compress`` call it
    allreduce       "module:function" of its allreduce (``comm, tensor, *, op, async_op`` and the
                    keywords below), which also holds its two-rank gathered form; imported on first use
    roundtrip       "module:function" ``(x, out)``: one compress + decompress of fp32 ``x`` into ``out``,
                    which the tuner's probe times (``tuning/auto_compression.py``)
    gathered        "module:function" of the two-rank form (one all_gather of the whole compressed
                    tensor), or None: then two ranks run the two-shot like any other count
    align           ``align(block)``: the elements every chunk but the trailing ones is a multiple of
    slot_words      ``slot_words(c, block, scales)``: the wire elements of one chunk of ``c`` elements
    word_bytes      bytes per wire element (4: int32 words; 2: 16-bit values)
    bits            ``bits(block)``: wire bits per element of a large tensor (the simulator's ratio)
    error           the per-element error bound of one call, in words
    worker_residual, server_residual   whether it keeps error feedback on the worker / server side
    takes_block, scale_groups          whether its allreduce takes ``block`` / ``groups``
    options         fixed keywords of its allreduce (e.g. the wire dtype of a 16-bit row)
    dtypes          tensor dtypes it accepts (names, as torch spells them without "torch.")
    auto            whether ``compression="auto"`` may choose it (the others must be named)

"none" and "auto" are not methods but *choices* (``choices()``): full precision, or the rule of
tuning/auto_compression.py picking among the rows with ``auto`` per size. Names are identifiers that are
neither. This module imports nothing of torch or of the rest of the package (``options.py``
validates against it); the functions a row names are imported when first called (``resolve``).

Adding a method (docs/compression.md): write its kernels and its allreduce, then
``register(Method(name="int2", allreduce="mypkg.int2:allreduce_int2", ...))``: from then on the
options, the hooks (``compress_hook("int2")``), per-level compression, the tuner's probe and the
simulator know it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["AUTO", "DEFAULT", "NONE", "Method", "auto_names", "choices", "check_choice", "get", "layout", "names",
           "register", "resolve", "unregister"]

NONE = "none"   # the choice of full precision
AUTO = "auto"   # the choice of tuning/auto_compression.py's rule, per size, among auto_names()
DEFAULT = "int8"  # the method a compressed call runs when none is named (per_level.allreduce)
_RUNTIME = "ddl_triton.runtime.compression."
_FLOATS = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Method:
    """One compression method: a row of the table (module doc for each field)."""

    name: str
    summary: str
    allreduce: str
    roundtrip: str
    align: Callable[[int], int]
    slot_words: Callable[[int, int, int], int]
    word_bytes: int
    bits: Callable[[int], float]
    error: str
    gathered: str | None = None
    worker_residual: bool = False
    server_residual: bool = False
    takes_block: bool = False
    scale_groups: bool = False
    options: tuple = ()
    dtypes: tuple = _FLOATS
    auto: bool = False

    def run(self, comm, tensor, *, op: str = "avg", block: int = 256, residual=None, server_residual=None,
            groups=None, async_op: bool = False):
        """This method's allreduce of ``tensor`` over ``comm`` in place: the keywords it takes are
        passed on, a residual or ``groups`` it does not take, or a dtype it does not accept, is
        refused (naming the rank)."""
        dtype = str(getattr(tensor, "dtype", type(tensor).__name__)).removeprefix("torch.")
        if dtype not in self.dtypes:
            raise TypeError(f"rank {comm.rank}: compression {self.name!r} takes {', '.join(self.dtypes)} tensors, "
                            f"got {dtype}")
        kwargs = dict(self.options)
        for key, value, takes in (("block", block, self.takes_block), ("residual", residual, self.worker_residual),
                                  ("server_residual", server_residual, self.server_residual),
                                  ("groups", groups, self.scale_groups)):
            if takes:
                kwargs[key] = value
            elif value is not None and key != "block":
                raise ValueError(f"rank {comm.rank}: compression {self.name!r} takes no {key}")
        return resolve(self.allreduce)(comm, tensor, op=op, async_op=async_op, **kwargs)

    def wire_ratio(self, block: int = 256) -> float:
        """fp32 bytes over wire bytes for a large tensor: 32 / bits(block)."""
        return 32.0 / self.bits(block)


def _int8() -> Method:
    return Method(
        name="int8", summary="int8 values + one fp32 scale per block of elements",
        allreduce=_RUNTIME + "compressed:allreduce_int8", gathered=_RUNTIME + "gathered:int8",
        roundtrip="ddl_triton.kernels.int8:roundtrip_int8",
        align=lambda block: block, slot_words=lambda c, block, scales: c // 4 + c // block, word_bytes=4,
        bits=lambda block: 8 + 32 / block,
        error="within (s_w + s_r)(1/2 + 2**-16) of the mean, s_w and s_r the block's absmax/127 before and "
              "after the reduction (two ranks: s_w(1/2 + 2**-16)); what the worker lost is re-sent",
        worker_residual=True, takes_block=True, auto=True)


def _onebit() -> Method:
    return Method(
        name="onebit", summary="1 sign bit per element + one fp32 scale (mean |v|) per chunk or group",
        allreduce=_RUNTIME + "compressed:allreduce_onebit", gathered=_RUNTIME + "gathered:onebit",
        roundtrip="ddl_triton.kernels.onebit:roundtrip_onebit",
        align=lambda block: 32, slot_words=lambda c, block, scales: c // 32 + max(1, scales), word_bytes=4,
        bits=lambda block: 1.0,
        error="each element +-scale of its chunk: one call is crude, but both sides' errors are kept and "
              "re-sent, so the updates' sum tracks the lossless one up to the current residuals",
        worker_residual=True, server_residual=True, scale_groups=True)


def _sixteen_bit(name: str, wire_dtype: str, precision: str) -> Method:
    # fp16 and bf16 share one layout and one allreduce: rows differ in their wire dtype only
    return Method(
        name=name, summary=f"{wire_dtype} values (fp32 accumulation, one rounding)",
        allreduce=_RUNTIME + "compressed:allreduce_16bit", gathered=_RUNTIME + "gathered:sixteen_bit",
        roundtrip=f"ddl_triton.kernels.sixteen_bit:roundtrip_{wire_dtype}",
        align=lambda block: 1, slot_words=lambda c, block, scales: c, word_bytes=2, bits=lambda block: 16.0,
        error=f"the mean of the inputs rounded to {wire_dtype}, rounded once to {wire_dtype} ({precision})",
        options=(("wire_dtype", wire_dtype),))


def _int4() -> Method:
    # Streaming DiLoCo's 4-bit pseudo-gradients. align: whole blocks and whole int32 words (8 values).
    return Method(
        name="int4", summary="4-bit values (two a byte) + one fp32 scale per block of elements",
        allreduce=_RUNTIME + "int4:allreduce_int4", gathered=_RUNTIME + "gathered:int4",
        roundtrip="ddl_triton.kernels.int4:roundtrip_int4",
        align=lambda block: max(block, 8), slot_words=lambda c, block, scales: c // 8 + c // block, word_bytes=4,
        bits=lambda block: 4 + 32 / block,
        error="within (s_w + s_r)(1/2 + 2**-16) of the mean of the ranks' x + residual (+ server residual), "
              "s_w the ranks' mean and s_r the reduced value's block absmax/7 (up to 32 ranks; two ranks: "
              "s_w(1/2 + 2**-16)); what the worker and the server lost is re-sent",
        worker_residual=True, server_residual=True, takes_block=True)


_TABLE: dict[str, Method] = {m.name: m for m in (
    _int8(), _onebit(),
    _sixteen_bit("fp16", "float16", "relative error 2**-11; beyond 65504, inf"),
    _sixteen_bit("bf16", "bfloat16", "relative error 2**-8, fp32's range"),
    _int4(),
)}
_BUILT_IN = frozenset(_TABLE)
# An older name of a layout, still accepted where a layout is looked up (compressed.wire_bytes):
# fp16 and bf16 share the 16-bit one.
_LAYOUT_ALIASES = {"16bit": "fp16"}


def names() -> tuple[str, ...]:
    """Every registered method, in registration order."""
    return tuple(_TABLE)


def auto_names() -> tuple[str, ...]:
    """The methods ``compression="auto"`` may choose besides full precision."""
    return tuple(n for n, m in _TABLE.items() if m.auto)


def choices() -> tuple[str, ...]:
    """What ``Options.compression`` and ``HookState(compression=...)`` accept: "none", every method, "auto"."""
    return (NONE, *_TABLE, AUTO)


def check_choice(value: str, what: str) -> str:
    """``value`` if it is one of ``choices()``, else ValueError ``"<what> must be one of ..., got ..."``."""
    if value not in choices():
        raise ValueError(f"{what} must be one of {', '.join(choices())}, got {value!r}")
    return value


def get(name: str) -> Method:
    """The row of method ``name``; an unknown name raises ValueError listing the valid ones."""
    row = _TABLE.get(name) if isinstance(name, str) else None
    if row is None:
        raise ValueError(f"unknown compression method {name!r}; valid: {', '.join(names())}")
    return row


def layout(name: str) -> Method:
    """The row whose wire layout ``name`` is: a method's name, or "16bit" (the older name of the
    layout fp16 and bf16 share, which compressed.wire_bytes still accepts)."""
    return get(_LAYOUT_ALIASES.get(name, name) if isinstance(name, str) else name)


def register(method: Method, *, replace: bool = False) -> None:
    """Add a row: from now on every reader of the table knows ``method.name`` (module doc).

    The name must be an identifier, not "none" or "auto"; an existing name is refused unless
    ``replace=True``. The functions the row names are imported on first use, not here."""
    if not isinstance(method, Method):
        raise TypeError(f"register takes a compression_methods.Method, got {type(method).__name__}")
    name = method.name
    if not (isinstance(name, str) and name.isidentifier()) or name in (NONE, AUTO) or name in _LAYOUT_ALIASES:
        raise ValueError(f"a compression method's name must be an identifier other than {NONE!r} and {AUTO!r}, "
                         f"got {name!r}")
    if name in _TABLE and not replace:
        raise ValueError(f"compression method {name!r} is already registered (pass replace=True to replace it)")
    for ref in (method.allreduce, method.roundtrip, *((method.gathered,) if method.gathered else ())):
        _split(ref)
    if method.word_bytes not in (1, 2, 4, 8):
        raise ValueError(f"compression method {name!r}: word_bytes must be 1, 2, 4 or 8, got {method.word_bytes}")
    _TABLE[name] = method


def unregister(name: str) -> None:
    """Remove a method added with ``register`` (the built-in ones stay)."""
    if name in _BUILT_IN:
        raise ValueError(f"compression method {name!r} is built in and cannot be removed")
    get(name)
    del _TABLE[name]


def resolve(ref: str):
    """The object a row names as "module:attribute", imported now (the first call of a method)."""
    module, attr = _split(ref)
    return getattr(importlib.import_module(module), attr)


def _split(ref) -> tuple[str, str]:
    module, sep, attr = ref.partition(":") if isinstance(ref, str) else ("", "", "")
    if not (sep and module and attr.isidentifier()):
        raise ValueError(f"a compression method names its functions as 'module:function', got {ref!r}")
    return module, attr
