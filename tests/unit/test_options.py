"""The options object: defaults, DDL_* environment twins read once, and clear refusals."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddl_triton import Options
from ddl_triton.options import known_variables


def test_defaults_without_environment():
    o = Options.from_env({})
    assert o == Options()
    assert o.pipeline_depth >= 2 and o.timeout > 0


def test_environment_twins_are_parsed_and_overrides_win():
    env = {"DDL_TIMEOUT": "2.5", "DDL_CHUNK_BYTES": "0x1000", "DDL_PIPELINE_DEPTH": "3",
           "DDL_SCHEDULE": "ring", "DDL_TRANSPORT": "mpi", "DDL_KERNELS": "triton", "DDL_TOPOLOGY": ""}
    o = Options.from_env(env, pipeline_depth=5)
    assert (o.timeout, o.chunk_bytes, o.pipeline_depth) == (2.5, 4096, 5)
    assert (o.schedule, o.transport, o.kernels) == ("ring", "mpi", "triton")
    assert o.topology == Options().topology  # an empty variable means "unset"


@pytest.mark.parametrize("env,match", [
    ({"DDL_TIMEOUT": "soon"}, "DDL_TIMEOUT='soon' is not a valid float"),
    ({"DDL_CHUNK_BYTES": "100"}, "multiple of 64"),
    ({"DDL_PIPELINE_DEPTH": "1"}, "pipeline_depth must be >= 2"),
    ({"DDL_TRANSPORT": "tcp"}, "transport must be"),
    ({"DDL_KERNELS": "cuda"}, "kernels must be"),
    ({"DDL_TIMEOUT": "0"}, "timeout must be > 0"),
])
def test_bad_values_are_refused_with_the_name(env, match):
    with pytest.raises(ValueError, match=match):
        Options.from_env(env)


def test_unknown_option_names_are_refused():
    with pytest.raises(TypeError, match="unknown option"):
        Options.from_env({}, chunk_size=4)


def test_options_are_immutable():
    o = Options()
    with pytest.raises(Exception):
        o.timeout = 1.0  # type: ignore[misc]
    assert o.replace(timeout=1.0).timeout == 1.0 and o.timeout == Options().timeout


def test_an_unknown_ddl_variable_gets_a_warning_naming_the_closest_known_one():
    with pytest.warns(UserWarning, match=r"DDL_TIMOIT is set, but ddl_triton reads no such variable \(ignored\): "
                                         r"did you mean DDL_TIMEOUT\?"):
        o = Options.from_env({"DDL_TIMOIT": "5"})
    assert o.timeout == Options().timeout  # ignored, as said
    with pytest.warns(UserWarning, match="DDL_QQQ is set.*listed in docs/options.md"):
        Options.from_env({"DDL_QQQ": "1"})


def test_every_known_ddl_variable_passes_without_a_warning(recwarn):
    Options.from_env({name: "" for name in known_variables()})
    assert not [w for w in recwarn if "DDL_" in str(w.message)]


def test_every_ddl_variable_the_repository_names_is_a_known_one():
    """The known list is the one place: a DDL_* name read or set anywhere (the package, its launcher
    and testbed, the benchmarks, the examples, the tests' workers and CI) must be in it, or the
    warning above would fire for a variable that something does read. (tests/unit/ is left out: its
    tests spell wrong names on purpose.)"""
    root = Path(__file__).resolve().parents[2]
    files = [p for d in ("ddl_triton", "transports", "schedules", "bench", "examples", "tests")
             for p in (root / d).rglob("*.py") if "unit" not in p.relative_to(root).parts]
    files += [root / "Makefile", *sorted((root / ".ci").glob("*"))]
    named = {}
    for path in files:
        for name in re.findall(r"\bDDL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")):
            named.setdefault(name, str(path.relative_to(root)))
    unknown = {n: where for n, where in named.items() if n not in known_variables()}
    assert not unknown, f"DDL_* names not in options.known_variables() (add them to OTHER_VARIABLES): {unknown}"
