"""pyproject.toml's hand-written package list cannot drift from the tree (a wheel once lacked
ddl_triton.torch.elastic): every folder that holds a module is a listed package, every listed
package is such a folder, and every other file in them is named by a package-data pattern.
Each check is also run on a planted tree, so that a check which could never fail fails here.
The built wheel itself is compared with the tree in tests/multirank/test_installed_wheel.py."""
from __future__ import annotations

import subprocess

from support.package_tree import Layout, read_layout, tree, tree_files, tree_packages, undeclared_data


def test_the_package_list_is_every_folder_that_holds_a_module():
    layout = read_layout()
    found = tree_packages(layout, tree())
    missing, extra = sorted(found - set(layout.packages)), sorted(set(layout.packages) - found)
    assert not missing, f"pyproject.toml's [tool.setuptools] packages misses {missing}: a wheel would lack them"
    assert not extra, f"pyproject.toml lists {extra}, which no folder of the tree holds"
    assert len(layout.packages) == len(set(layout.packages)), "pyproject.toml lists a package twice"


def test_every_data_file_in_a_package_is_declared():
    files = undeclared_data(read_layout(), tree())
    assert not files, f"no [tool.setuptools.package-data] pattern names {files}: a wheel would lack them"


def test_the_checks_find_a_missing_package_an_extra_one_and_undeclared_data(tmp_path):
    for path, text in {"pkg/__init__.py": "", "pkg/sub/__init__.py": "", "pkg/sub/data/a.toml": "",
                       "pkg/loose/mod.py": "", "pkg/sub/notes.txt": "", "top/__init__.py": "",
                       "top/deep/x.py": "", "elsewhere/y.py": ""}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("*.txt\n")  # ignored files are in no clone: not expected
    layout = Layout(["pkg", "pkg.sub", "pkg.top", "pkg.gone"], {"pkg": "pkg", "pkg.top": "top"},
                    {"pkg.sub": ["data/*.toml"]})
    files = tree(tmp_path)
    assert tree_packages(layout, files) == {"pkg", "pkg.sub", "pkg.loose", "pkg.top", "pkg.top.deep"}
    assert undeclared_data(layout, files) == []
    (tmp_path / "pkg/sub/data/b.json").write_text("{}")
    assert undeclared_data(layout, tree(tmp_path)) == ["pkg/sub/data/b.json"]
    assert "pkg/top/deep/x.py" in tree_files(layout, files) and "pkg/sub/notes.txt" not in tree_files(layout, files)
    assert not any(f.startswith("elsewhere") for f in tree_files(layout, files))
