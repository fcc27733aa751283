import os
from pathlib import Path

# The Triton kernels run on CPU tensors only through the interpreter, and triton reads this
# when it is first imported: set it before any test module imports ddl_triton (and triton).
os.environ["TRITON_INTERPRET"] = "1"

# ddl_triton.init looks for a cached tuning table (ddl-tune's) matching the machine: the suite
# must not pick up one a developer made, so every test, and every rank it launches, looks in
# an empty folder of its own (tests that want a table name one with DDL_TUNING_FILE).
import tempfile  # noqa: E402

os.environ["DDL_TUNING_DIR"] = tempfile.mkdtemp(prefix="ddl_triton-test-tuning-")

# Workers that tests launch (mpiexec, ddlrun, torchrun) run as scripts from their own folder and
# import tests/support: every process the suite starts finds it through PYTHONPATH.
_TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH", "")) if p)
