"""Launch configurations of the Triton kernels, as plain data you can read, edit and extend.

``LAUNCH_CONFIGS`` maps a kernel name to its candidate configurations. A configuration is a dict
of the kernel's block-size meta-parameter (``META_PARAMETERS`` says which, and what it means)
plus ``num_warps`` and ``num_stages`` (optional: 4 and 3, ``triton.Config``'s defaults)::

    LAUNCH_CONFIGS["reduce"] == [
        {"BLOCK": 1024, "num_warps": 4, "num_stages": 3},
        {"BLOCK": 2048, "num_warps": 8, "num_stages": 3},
        ...
    ]

What a kernel launches on a GPU, decided at every launch from the data as it is then:
    - pinned (``pin``, or ``apply`` of a tuning table): exactly the pinned config, no autotuning;
    - otherwise: Triton autotunes over every candidate, once per autotuning key (the kernel's
      sizes; see the kernel modules), and keeps the fastest for that key.
A pin wins over the candidates until ``unpin``. Editing the candidates or a pin after import
takes effect at the next launch: the autotuned wrapper is built per distinct list of configs and
cached, so going back to an earlier list reuses its tuning results.

Under ``TRITON_INTERPRET=1`` (CPU tests) the kernels launch one fixed, small block size, or the
pinned config's meta-parameter when the kernel is pinned; nothing is autotuned there.

Changing a config never changes a result: every kernel here is elementwise, or works on whole
int8 blocks / whole output bytes per program, so the block size only decides how the work is cut
into programs. A bad config fails with an error naming the kernel, not a wrong answer.

Kernels (``names()``): "reduce" (reduce.py, BLOCK); "quantize_int8", "dequantize_int8",
"reduce_int8" (int8.py, TILE: elements per program, rounded up to whole int8 blocks);
"add_into" (onebit.py: the 1-bit compressor's first pass, BLOCK); "sign_pack", "sign_unpack" (BYTES: output
bytes of packed signs per program, 8 elements each). pack/unpack (pack.py) are not here: their
BLOCK is fixed (4096 elements, 8 warps on a GPU) because the per-program table they cache is
built for one BLOCK; see pack.py's docstring.

Worked example::

    from ddl_triton.kernels import launch_configs as lc

    lc.names()                      # ['reduce', 'quantize_int8', ..., 'sign_unpack']
    lc.candidates("add_into")       # [{'BLOCK': 1024, 'num_warps': 4, 'num_stages': 3},
                                    #  {'BLOCK': 4096, 'num_warps': 8, 'num_stages': 3}]
    # Extend: also try a larger block (validated: BLOCK must be a power of two).
    lc.set_candidates("add_into", lc.candidates("add_into") + [{"BLOCK": 8192, "num_warps": 16}])
    # Use one config only, e.g. a winner of ddl_triton.kernels.config_sweep.sweep():
    lc.pin("reduce", {"BLOCK": 4096, "num_warps": 8, "num_stages": 1})
    lc.triton_configs("reduce")     # one triton.Config: BLOCK 4096, num_warps 8, num_stages 1
    lc.unpin("reduce")              # back to autotuning over the candidates
    # Pin several at once, from a tuning table's "kernels" section:
    lc.apply({"reduce": {"config": {"BLOCK": 4096, "num_warps": 8, "num_stages": 1}, "us": 41.2}})
    lc.reset()                      # the shipped table, nothing pinned

Editing ``LAUNCH_CONFIGS`` directly works too (it is read at every launch and validated when it
changes), but ``set_candidates`` checks the list at once and fills in num_warps / num_stages.
"""
from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import triton  # imported where a triton.Config or autotuner is built: see _lazy_kernels.py

DEFAULT_NUM_WARPS = 4   # triton.Config's defaults, written out so a config shows what it launches
DEFAULT_NUM_STAGES = 3

# The meta-parameter each kernel takes, and what it means. A config names exactly these.
META_PARAMETERS: dict[str, dict[str, str]] = {
    "reduce": {"BLOCK": "elements per program"},
    "quantize_int8": {"TILE": "elements per program, rounded up to whole int8 blocks"},
    "dequantize_int8": {"TILE": "elements per program, rounded up to whole int8 blocks"},
    "reduce_int8": {"TILE": "elements per program, rounded up to whole int8 blocks"},
    "add_into": {"BLOCK": "elements per program"},
    "sign_pack": {"BYTES": "output bytes (8 elements each) per program"},
    "sign_unpack": {"BYTES": "input bytes (8 elements each) per program"},
}

# The candidates: the values the kernels were hand-tuned with. Edit or extend freely.
LAUNCH_CONFIGS: dict[str, list[dict]] = {
    "reduce": [
        {"BLOCK": 1024, "num_warps": 4, "num_stages": 3},
        {"BLOCK": 2048, "num_warps": 8, "num_stages": 3},
        {"BLOCK": 4096, "num_warps": 8, "num_stages": 3},
        {"BLOCK": 8192, "num_warps": 16, "num_stages": 3},
    ],
    # TILE 8192 is left out: pinned on an H200 at 1 GiB it reached 63% (quantize) and 76%
    # (dequantize) of the device copy, against 87-88% and 94% for 2048 and 4096
    # (bench/results/gpu.md), so autotuning could only lose by trying it.
    "quantize_int8": [
        {"TILE": 2048, "num_warps": 4, "num_stages": 3},
        {"TILE": 4096, "num_warps": 8, "num_stages": 3},
    ],
    "dequantize_int8": [
        {"TILE": 2048, "num_warps": 4, "num_stages": 3},
        {"TILE": 4096, "num_warps": 8, "num_stages": 3},
    ],
    "reduce_int8": [
        {"TILE": 2048, "num_warps": 4, "num_stages": 3},
        {"TILE": 4096, "num_warps": 8, "num_stages": 3},
        {"TILE": 8192, "num_warps": 8, "num_stages": 3},
    ],
    "add_into": [
        {"BLOCK": 1024, "num_warps": 4, "num_stages": 3},
        {"BLOCK": 4096, "num_warps": 8, "num_stages": 3},
    ],
    "sign_pack": [
        {"BYTES": 256, "num_warps": 4, "num_stages": 3},
        {"BYTES": 512, "num_warps": 4, "num_stages": 3},
        {"BYTES": 1024, "num_warps": 8, "num_stages": 3},
    ],
    "sign_unpack": [
        {"BYTES": 256, "num_warps": 4, "num_stages": 3},
        {"BYTES": 512, "num_warps": 4, "num_stages": 3},
        {"BYTES": 1024, "num_warps": 8, "num_stages": 3},
    ],
}

# Triton's largest tensor has 2**20 elements; a sign program's tile is BYTES x 8.
_LARGEST = {"BLOCK": 1 << 20, "TILE": 1 << 20, "BYTES": 1 << 17}
_LAUNCH_KEYS = ("num_warps", "num_stages")
_SHIPPED = copy.deepcopy(LAUNCH_CONFIGS)
_PINNED: dict[str, dict] = {}
# (kernel, jit function, fingerprint of the configs in force) -> autotuned wrapper. One entry per
# distinct list a process launches with: a handful in practice, so it is not bounded.
_WRAPPERS: dict[tuple, object] = {}


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------

def names() -> list[str]:
    """The kernel names this table covers, in table order."""
    return list(META_PARAMETERS)


def meta_parameters(kernel: str) -> list[str]:
    """The meta-parameter names a config of ``kernel`` must give, e.g. ``["BLOCK"]``."""
    return list(META_PARAMETERS[_check_kernel(kernel)])


def candidates(kernel: str) -> list[dict]:
    """A copy of the candidate configs of ``kernel`` (editing it changes nothing; see set_candidates)."""
    return [dict(c) for c in LAUNCH_CONFIGS[_check_kernel(kernel)]]


def pinned(kernel: str) -> dict | None:
    """A copy of the config ``kernel`` is pinned to, or None when it autotunes over its candidates."""
    config = _PINNED.get(_check_kernel(kernel))
    return None if config is None else dict(config)


def triton_configs(kernel: str) -> list[triton.Config]:
    """What ``kernel`` launches with now: the pinned config alone when pinned, else every candidate.

    Raises ValueError, naming the kernel and the config, when a direct edit of LAUNCH_CONFIGS left
    an invalid entry.
    """
    import triton  # on first use, not with this module: see _lazy_kernels.py

    meta = META_PARAMETERS[_check_kernel(kernel)]
    return [triton.Config({k: c[k] for k in meta}, num_warps=c["num_warps"], num_stages=c["num_stages"])
            for c in _in_force(kernel)]


# --------------------------------------------------------------------------------------------
# editing
# --------------------------------------------------------------------------------------------

def set_candidates(kernel: str, configs: Sequence[Mapping]) -> None:
    """Replace the candidates of ``kernel`` (a non-empty list of distinct configs).

    Each config gives exactly the kernel's meta-parameter(s) (``meta_parameters(kernel)``) and
    optionally num_warps / num_stages (filled in with 4 / 3), all positive ints; block sizes and
    num_warps powers of two. Nothing changes when any config is invalid. A pin still wins.
    """
    _check_kernel(kernel)
    if isinstance(configs, (str, bytes, Mapping)) or not isinstance(configs, Sequence):
        raise TypeError(f"set_candidates: {kernel}: configs must be a list of dicts, got {type(configs).__name__}")
    if len(configs) == 0:
        raise ValueError(f"set_candidates: {kernel}: needs at least one config")
    checked = [_normalized(kernel, c, f"{kernel} config {i}") for i, c in enumerate(configs)]
    seen = set()
    for i, c in enumerate(checked):
        if _fingerprint([c]) in seen:
            raise ValueError(f"set_candidates: {kernel} config {i} repeats an earlier one: {c}")
        seen.add(_fingerprint([c]))
    LAUNCH_CONFIGS[kernel] = checked


def pin(kernel: str, config: Mapping) -> None:
    """Launch ``kernel`` with exactly ``config`` from now on (no autotuning), e.g. a tuned winner.

    The config is validated as in :func:`set_candidates`; it need not be among the candidates.
    """
    _check_kernel(kernel)
    _PINNED[kernel] = _normalized(kernel, config, f"{kernel} pinned config")


def unpin(kernel: str) -> None:
    """Go back to autotuning ``kernel`` over its candidates (no-op when not pinned)."""
    _PINNED.pop(_check_kernel(kernel), None)


def apply(winners: Mapping[str, Mapping]) -> dict[str, dict]:
    """Pin several kernels at once; the runtime calls this with a tuning table's "kernels" section.

    ``winners`` maps kernel name -> either an entry ``{"config": {...}, ...}`` (other keys, such as
    the measured "us", are ignored) or a bare config dict. All are validated before any is pinned,
    so an invalid table changes nothing. Kernels not named keep their state. Returns the pinned
    configs, normalized (num_warps / num_stages filled in).
    Example: apply({"reduce": {"config": {"BLOCK": 4096, "num_warps": 8, "num_stages": 1}}})
    """
    if not isinstance(winners, Mapping):
        raise TypeError(f"apply: expected a dict of kernel name -> config, got {type(winners).__name__}")
    checked = {}
    for kernel, entry in winners.items():
        _check_kernel(kernel)
        config = entry.get("config") if isinstance(entry, Mapping) and "config" in entry else entry
        checked[kernel] = _normalized(kernel, config, f"{kernel} config in the applied table")
    _PINNED.update(checked)
    return {k: dict(c) for k, c in checked.items()}


def reset(kernel: str | None = None) -> None:
    """Restore the shipped candidates and unpin, for ``kernel`` or (None) every kernel."""
    for k in names() if kernel is None else [_check_kernel(kernel)]:
        LAUNCH_CONFIGS[k] = copy.deepcopy(_SHIPPED[k])
        _PINNED.pop(k, None)


# --------------------------------------------------------------------------------------------
# for the kernel modules
# --------------------------------------------------------------------------------------------

def autotuned(kernel: str, fn: Callable, *, key: Sequence[str], restore_value: Sequence[str] | None = None):
    """``triton.autotune(configs=triton_configs(kernel), key=key, restore_value=...)(fn)``, as of now.

    Called at every GPU launch; returns a cached wrapper while the configs in force are unchanged
    (and the earlier wrapper, with its tuning results, when they change back). The kernel modules
    own ``key`` and ``restore_value``, which never change for one ``fn``.
    """
    _check_kernel(kernel)
    try:
        cache_key = (kernel, fn, _fingerprint(_in_force_raw(kernel)))
        wrapper = _WRAPPERS.get(cache_key)
    except (AttributeError, TypeError):  # a malformed direct edit: triton_configs below names it
        cache_key, wrapper = None, None
    if wrapper is None:
        import triton  # on first use, not with this module: see _lazy_kernels.py

        configs = triton_configs(kernel)
        # The timer is looked up at each trial, not bound here, so a test can stand in for it.
        wrapper = triton.autotune(configs=configs, key=list(key),
                                  restore_value=None if restore_value is None else list(restore_value),
                                  do_bench=lambda kernel_call, quantiles: _trial_timer(kernel_call, quantiles))(fn)
        if cache_key is not None:
            _WRAPPERS[cache_key] = wrapper
    return wrapper


# How long autotuning times each candidate: Triton's default (25 ms of warm-up, then 100 ms of
# calls, per candidate) made every new size of a collective's chunk cost about 0.5 s at its first
# launch, and the CUDA test tier, which meets ~100 sizes, ran past two minutes on an H200. These
# kernels stream memory, so a few milliseconds of calls rank the candidates as well.
AUTOTUNE_WARMUP_MS = 2
AUTOTUNE_REP_MS = 10


def _trial_timer(kernel_call, quantiles):
    import triton.testing  # on first use, not with this module: see _lazy_kernels.py
    return triton.testing.do_bench(kernel_call, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS, quantiles=quantiles)


def interpreter_meta(kernel: str, **fallback: int) -> dict[str, int]:
    """The meta-parameters an interpreted launch uses: the pinned config's when ``kernel`` is
    pinned (so a CPU test can see a pin reach the launch), else ``fallback`` (the interpreter's
    fixed sizes). num_warps / num_stages are left out: the interpreter has no warps."""
    config = _PINNED.get(_check_kernel(kernel))
    if config is None:
        return fallback
    return {k: config[k] for k in META_PARAMETERS[kernel]}


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------

def _check_kernel(kernel) -> str:
    if not isinstance(kernel, str) or kernel not in META_PARAMETERS:
        raise ValueError(f"unknown kernel {kernel!r}; valid: {', '.join(META_PARAMETERS)}")
    return kernel


def _in_force_raw(kernel: str) -> list:
    config = _PINNED.get(kernel)
    return [config] if config is not None else LAUNCH_CONFIGS.get(kernel)


def _in_force(kernel: str) -> list[dict]:
    """The configs in force, validated: a direct edit of LAUNCH_CONFIGS is checked here."""
    config = _PINNED.get(kernel)
    if config is not None:
        return [config]  # validated by pin / apply
    configs = LAUNCH_CONFIGS.get(kernel)
    if not isinstance(configs, Sequence) or isinstance(configs, (str, bytes)) or len(configs) == 0:
        raise ValueError(f"LAUNCH_CONFIGS[{kernel!r}] must be a non-empty list of configs, got {configs!r}")
    return [_normalized(kernel, c, f"LAUNCH_CONFIGS[{kernel!r}][{i}]") for i, c in enumerate(configs)]


def _fingerprint(configs: Sequence[Mapping]) -> tuple:
    return tuple(tuple(sorted(c.items())) for c in configs)


def _normalized(kernel: str, config, where: str) -> dict:
    """A validated copy of ``config`` with num_warps / num_stages filled in; ``where`` names it in errors."""
    meta = META_PARAMETERS[kernel]
    keys = f"a {kernel} config has {', '.join(meta)} and optionally {', '.join(_LAUNCH_KEYS)}"
    if not isinstance(config, Mapping):
        raise TypeError(f"{where}: a config is a dict, got {type(config).__name__} ({keys})")
    missing = [k for k in meta if k not in config]
    unknown = [k for k in config if k not in meta and k not in _LAUNCH_KEYS]
    if missing or unknown:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + \
                   ([f"unknown key(s) {', '.join(map(repr, unknown))}"] if unknown else [])
        raise ValueError(f"{where}: {'; '.join(problems)} ({keys})")
    out = {k: config[k] for k in meta}
    out["num_warps"] = config.get("num_warps", DEFAULT_NUM_WARPS)
    out["num_stages"] = config.get("num_stages", DEFAULT_NUM_STAGES)
    for k, v in out.items():
        # bool is an int to Python, but True as a block size is surely a mistake.
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{where}: {k} must be a positive int, got {v!r}")
        out[k] = v = int(v)  # numpy ints from a loaded table become plain ints
        if k != "num_stages" and v & (v - 1):
            # tl.arange needs a power of two; Triton refuses other warp counts.
            raise ValueError(f"{where}: {k} must be a power of two, got {v}")
        if k in _LARGEST and v > _LARGEST[k]:
            raise ValueError(f"{where}: {k} must be at most {_LARGEST[k]}, got {v}")
    return out
