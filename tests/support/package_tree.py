"""What the source tree says a built distribution must hold, read from pyproject.toml and the tree.

pyproject.toml lists the packages by hand (setuptools' finder cannot map transports/, schedules/ and
examples/ into ``ddl_triton``'s namespace) and maps each installed package to a folder
(``package-dir``). The tree is what git sees, tracked files and untracked ones it does not ignore:
what a clone holds, plus the edits not yet committed. From both:

- ``tree_packages``: every folder under a mapped one that holds a module, as the package it installs as;
- ``undeclared_data``: every other file in such a package folder that no ``package-data`` pattern names;
- ``tree_files``: every file under a mapped folder, as its path inside the wheel: what a wheel must hold.

``tests/unit/test_packaging.py`` compares the first two with pyproject.toml; ``test_installed_wheel.py``
compares the third with a wheel built from the tree.
"""
from __future__ import annotations

import fnmatch
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Layout:
    """pyproject.toml's packaging: the package list, each package's folder, its data patterns."""
    packages: list[str]
    package_dir: dict[str, str]
    package_data: dict[str, list[str]] = field(default_factory=dict)

    def folder(self, package: str) -> str:
        """The folder (relative to the root, '/'-separated) that ``package`` installs from."""
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):  # the longest mapped prefix wins, as in setuptools
            head = ".".join(parts[:cut])
            if head in self.package_dir:
                return "/".join([self.package_dir[head].strip("/"), *parts[cut:]]).strip("/")
        return "/".join(parts)

    def tops(self) -> dict[str, str]:
        """Each mapped folder and its package: {folder: package}."""
        return {folder.strip("/"): package for package, folder in self.package_dir.items()}


def read_layout(root: Path = ROOT) -> Layout:
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return Layout(list(config["packages"]), dict(config.get("package-dir", {})), dict(config.get("package-data", {})))


def tree(root: Path = ROOT) -> list[str]:
    """Every file git sees in ``root`` ('/'-separated, relative): tracked, and untracked unless ignored;
    a tracked file deleted in the work tree is left out."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def _in_tops(layout: Layout, files: list[str]) -> list[tuple[str, str, str]]:
    """(file, package of its folder, path in the wheel) for each file under a mapped folder (the
    deepest one where mapped folders nest)."""
    tops = sorted(layout.tops().items(), key=lambda item: -len(item[0]))
    found = []
    for f in files:
        top, package = next(((t, p) for t, p in tops if f.startswith(t + "/")), (None, None))
        if top is not None:
            rel = PurePosixPath(f[len(top) + 1:])
            found.append((f, ".".join([package, *rel.parent.parts]), "/".join([*package.split("."), *rel.parts])))
    return found


def tree_packages(layout: Layout, files: list[str]) -> set[str]:
    """The packages the tree holds: each folder under a mapped folder that holds a ``.py`` file."""
    return {pkg for f, pkg, _ in _in_tops(layout, files) if f.endswith(".py")}


def undeclared_data(layout: Layout, files: list[str]) -> list[str]:
    """Files other than modules under a mapped folder that no package-data pattern of a package
    above them names (patterns are relative to their package's folder, as setuptools reads them)."""
    missing = []
    for f, _, _ in _in_tops(layout, files):
        if f.endswith(".py"):
            continue
        named = any(f.startswith(layout.folder(pkg) + "/") and
                    any(fnmatch.fnmatch(f[len(layout.folder(pkg)) + 1:], pat) for pat in pats)
                    for pkg, pats in layout.package_data.items())
        if not named:
            missing.append(f)
    return missing


def tree_files(layout: Layout, files: list[str]) -> set[str]:
    """The paths a wheel built from the tree must hold, its .dist-info aside: every file under a
    mapped folder, where it installs."""
    return {wheel_path for _, _, wheel_path in _in_tops(layout, files)}
