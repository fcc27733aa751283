"""``python -m ddl_triton.trace``: merge, summarise, plot and diagnose timelines and flight-recorder
dumps; it lives in ddl_triton/observability/trace_command.py."""
from .observability.trace_command import main

if __name__ == "__main__":
    raise SystemExit(main())
