"""``python -m ddl_triton.simulate``: predict collectives and training on clusters we do not have;
it lives in ddl_triton/simulation/."""
from .simulation.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
