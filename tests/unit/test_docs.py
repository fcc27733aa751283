"""The documentation cannot drift from the code it describes.

- docs/options.md's table has exactly one row per ``ddl_triton.options.Options`` field, with the
  field's ``DDL_*`` twin, type and default;
- every relative link in README.md, docs/*.md and bench/results/*.md names a file that exists, and
  a heading that exists where it names one;
- every source path they name in code (`ddl_triton/launch/rank_guard.py`) exists;
- the README stays a front page: short, no line wider than 100 characters, with the two set-up
  commands that CI and new users run and the venv's activation, and every command it shows names a
  program the set-up installs and files that exist.

Each checker is also run on a broken sample, so that a check which could never fail fails here.
"""
from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

from ddl_triton.options import Options

ROOT = Path(__file__).resolve().parents[2]
OPTIONS_DOC = ROOT / "docs" / "options.md"
README_MAX_LINES = 170
README_MAX_WIDTH = 100  # a newcomer reads it in a terminal or an editor, not only on a web page
# [text](target) and ![alt](target); the target ends at the first space or closing parenthesis
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`+[^`\n]*`+")


def _cell(text: str) -> str:
    """A table cell without its surrounding space and code backticks."""
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == "`" else text


def options_rows(markdown: str) -> dict[str, dict[str, str]]:
    """The options table's rows by field name: {"env", "type", "default"}, each as written."""
    rows: dict[str, dict[str, str]] = {}
    header = None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set("".join(cells)) <= set("-: "):
            continue  # the separator line
        if header[:4] == ["field", "env twin", "type", "default"]:
            name = _cell(cells[0])
            assert name not in rows, f"options.md: two rows for {name!r}"
            rows[name] = {"env": _cell(cells[1]), "type": cells[2], "default": _cell(cells[3])}
    return rows


def options_table_problems(markdown: str) -> list[str]:
    """What the options table gets wrong about ``Options``; empty when it matches."""
    rows = options_rows(markdown)
    problems = []
    fields = {f.name: f for f in dataclasses.fields(Options)}
    for name, f in fields.items():
        row = rows.get(name)
        if row is None:
            problems.append(f"{name}: no row")
            continue
        if row["env"] != "DDL_" + name.upper():
            problems.append(f"{name}: twin {row['env']!r}, the options object reads DDL_{name.upper()}")
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if row["type"] != kind:
            problems.append(f"{name}: type {row['type']!r}, the field is {kind}")
        try:
            default = ast.literal_eval(row["default"])
        except (ValueError, SyntaxError):
            problems.append(f"{name}: default {row['default']!r} is not a Python literal")
            continue
        if type(default) is not type(f.default) or default != f.default:
            problems.append(f"{name}: default {row['default']}, the field's is {f.default!r}")
    problems += [f"{name}: a row, but no such field" for name in rows if name not in fields]
    return problems


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation dropped
    (hyphens and underscores kept), spaces as hyphens; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def broken_links(path: Path) -> list[str]:
    """The relative links of a markdown file whose file, or whose anchor in a markdown file, does
    not exist (links inside code are not read)."""
    text = _INLINE_CODE.sub("", _FENCE.sub("", path.read_text()))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # a URL (https:, mailto:)
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part) if file_part else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    return broken


def missing_paths(path: Path) -> list[str]:
    """The repository paths a markdown file names in code (`ddl_triton/launch/rank_guard.py`,
    `tests/unit/`) that do not exist. A path is a code span with a slash and no wildcard or
    placeholder; the rooms may be named short (`runtime/` for ddl_triton/runtime/). ``shared/``
    is the project's notes outside the checkout."""
    missing = []
    for span in re.findall(r"`([A-Za-z0-9_.-]+/[A-Za-z0-9_./-]*)`", path.read_text()):
        if span.startswith("shared/") or not (span.endswith("/") or re.search(r"\.[a-z]+$", span)):
            continue
        if not any((base / span).exists() for base in (ROOT, ROOT / "ddl_triton")):
            missing.append(span)
    return missing


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "bench" / "results").glob("*.md"))]


def test_the_options_table_matches_the_options_object():
    assert options_table_problems(OPTIONS_DOC.read_text()) == []


def test_the_options_check_fails_on_a_missing_row_a_wrong_twin_type_or_default_and_an_extra_row():
    text = OPTIONS_DOC.read_text()
    assert re.search(r"^\| `timeout` .*\n", text, re.M), "the sample edits below expect this row"
    missing = re.sub(r"^\| `timeout` .*\n", "", text, flags=re.M)
    assert options_table_problems(missing) == ["timeout: no row"]
    wrong_default = text.replace("| `pipeline_depth` | `DDL_PIPELINE_DEPTH` | int | `4` |",
                                 "| `pipeline_depth` | `DDL_PIPELINE_DEPTH` | int | `8` |")
    assert options_table_problems(wrong_default) == ["pipeline_depth: default 8, the field's is 4"]
    wrong_twin = text.replace("| `debug` | `DDL_DEBUG` |", "| `debug` | `DDL_DEBUGGING` |")
    assert options_table_problems(wrong_twin) == ["debug: twin 'DDL_DEBUGGING', the options object reads DDL_DEBUG"]
    wrong_type = text.replace("| `timeout` | `DDL_TIMEOUT` | float |", "| `timeout` | `DDL_TIMEOUT` | int |")
    assert options_table_problems(wrong_type) == ["timeout: type 'int', the field is float"]
    int_for_float = text.replace("| float | `300.0` |", "| float | `300` |")
    assert options_table_problems(int_for_float) == ["timeout: default 300, the field's is 300.0"]
    extra = text.rstrip("\n") + "\n| `colour` | `DDL_COLOUR` | str | `\"\"` | no such option |\n"
    assert options_table_problems(extra) == ["colour: a row, but no such field"]


def test_every_relative_link_points_at_a_file_that_exists():
    broken = {str(p.relative_to(ROOT)): b for p in _markdown_files() if (b := broken_links(p))}
    assert broken == {}


def test_every_source_path_the_docs_name_exists():
    missing = {str(p.relative_to(ROOT)): m for p in _markdown_files() if (m := missing_paths(p))}
    assert missing == {}


def test_the_path_check_finds_a_moved_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`ddl_triton/options.py` `runtime/` `tests/unit/` `ddl_triton/launcher.py` `transports/gone/`\n"
                    "`shared/SCALE_INPUTS.md` `DIR/trace-rank<R>.json` `clusters/*.toml` `mpi:bw=1GB/s`\n")
    assert missing_paths(page) == ["ddl_triton/launcher.py", "transports/gone/"]


def test_the_link_check_finds_broken_files_and_anchors_and_ignores_code_and_urls(tmp_path):
    (tmp_path / "there.md").write_text("# There\n## The `init()` part, again\n## Part\n## Part\n")
    page = tmp_path / "page.md"
    page.write_text("# Top\n[ok](there.md) [ok too](there.md#the-init-part-again) [twice](there.md#part-1)\n"
                    "[gone](missing.md) ![img](gone.png) [no such part](there.md#elsewhere)\n"
                    "[web](https://example.org/x) [here](#top) [not here](#bottom) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.md", "gone.png", "there.md#elsewhere", "#bottom"]


def test_the_readme_is_a_front_page_with_the_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "make demo" in readme and "make test" in readme  # CI's .ci/run and new users run them
    assert "docs/options.md" in readme  # the options table lives there, not repeated here
    wide = [f"{n}: {len(line)}" for n, line in enumerate(readme.splitlines(), 1) if len(line) > README_MAX_WIDTH]
    assert not wide, f"README.md lines wider than {README_MAX_WIDTH} characters (line: width): {wide}"


def readme_commands(readme: str) -> list[str]:
    """The lines of the README's ``sh`` blocks, comments and blank lines aside."""
    blocks = re.findall(r"^```sh\n(.*?)^```", readme, re.S | re.M)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def unrunnable(readme: str, bin_dir: Path) -> list[str]:
    """The README's commands a newcomer could not run as written after the set-up and the venv's
    activation: one whose program (after ``VAR=value`` words) is neither ``make``, the activation,
    nor in the venv's ``bin_dir``, or that names a ``.py`` file which neither exists nor is one the
    README says to save ("Save this as `x.py`")."""
    saved = set(re.findall(r"[Ss]ave (?:this|it)\s+as\s+`([\w.]+)`", readme))
    bad = []
    for line in readme_commands(readme):
        words = line.split()
        program = next((w for w in words if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)), "")
        if program not in ("make", ".", "source") and not (bin_dir / program).exists():
            bad.append(f"{line}  (no {program} after the set-up)")
        bad += [f"{line}  (no {w})" for w in words if w.endswith(".py") and w not in saved and not (ROOT / w).exists()]
    return bad


def test_every_readme_command_runs_after_the_setup_and_activation():
    readme = (ROOT / "README.md").read_text()
    assert ". .venv/bin/activate" in readme, "the README must say to activate the venv"
    assert len(readme_commands(readme)) >= 10
    assert unrunnable(readme, Path(sys.executable).parent) == []


def test_the_command_check_finds_a_missing_program_and_file(tmp_path):
    (tmp_path / "tool").touch()
    readme = ("Save this as `mine.py`:\n```sh\nmake demo\n. .venv/bin/activate\ntool -n 2 -- python mine.py\n"
              "X=1 nosuch examples/demo.py   # a comment\ntool examples/gone.py\n```\n")
    assert unrunnable(readme, tmp_path) == ["X=1 nosuch examples/demo.py  (no nosuch after the set-up)",
                                            "tool examples/gone.py  (no examples/gone.py)"]
