"""ddl_triton.tensorflow.elastic's one-process checks (elastic_tf_cases.py), in a process of their own:
TensorFlow must never be imported into the suite's process (a later Triton load there aborts)."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("tensorflow") is None:  # found, not imported (see the module doc)
    pytest.skip("the Keras elastic room needs tensorflow (the [tensorflow] extra)", allow_module_level=True)


def test_the_keras_elastic_room_in_a_process_of_its_own():
    cases = Path(__file__).with_name("elastic_tf_cases.py")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert re.search(r"^3 passed in ", proc.stdout, re.M), out[-6000:]  # every case ran: none skipped or left out
