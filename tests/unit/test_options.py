"""The options object: defaults, DDL_* environment twins read once, and clear refusals."""
from __future__ import annotations

import pytest

from ddl_triton import Options


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
