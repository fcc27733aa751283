"""``python -m ddl_triton.tune``: the tuning sweep (``ddl-tune``); it lives in ddl_triton/tuning/."""
from .tuning.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
