"""Find a data file that ships with the package, by name or by path."""
from __future__ import annotations

from pathlib import Path


def named_file(name_or_path: str, folder: Path, suffix: str, kind: str) -> Path:
    """``name_or_path`` as a path when it has a suffix, else ``folder/<name><suffix>``.
    Example: ``named_file("minsky", CLUSTERS, ".toml", "cluster")`` -> ``.../clusters/minsky.toml``.
    Raises ValueError listing the shipped names when the file does not exist."""
    path = Path(name_or_path)
    if not path.suffix:
        path = folder / f"{name_or_path}{suffix}"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in folder.glob(f"*{suffix}")))
        raise ValueError(f"unknown {kind} {name_or_path!r}; known: {known} (or a path to a {suffix} file)")
    return path
