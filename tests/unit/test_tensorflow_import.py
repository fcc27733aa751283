"""ddl_triton.tensorflow without ranks and without paying TensorFlow's import: the ImportError that
names the extra. (Everything that needs TensorFlow runs in tests/multirank/tf_worker.py's one
launch, where the import is paid once per rank.)"""
from __future__ import annotations

import importlib
import sys

import pytest


def test_importing_without_tensorflow_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "ddl_triton.tensorflow" or m.startswith("ddl_triton.tensorflow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # what an absent package looks like to import
    with pytest.raises(ImportError, match=r"pip install 'ddl_triton\[tensorflow\]'"):
        importlib.import_module("ddl_triton.tensorflow")
    assert "ddl_triton.tensorflow" not in sys.modules  # a failed import leaves nothing half-made
