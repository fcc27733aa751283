"""ddl_triton/_private_files.py: a folder at a path another user could have planted is never
followed or trusted, and files are created 0600 without following a link, whatever the umask."""
from __future__ import annotations

import os
import pwd
import stat
import tempfile

import pytest

from ddl_triton._private_files import create_private_file, private_folder, write_private_file


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(autouse=True)
def _fallbacks_in_tmp_path(tmp_path, monkeypatch):
    """mkdtemp's fallback folders land in the test's folder, removed with it."""
    (tmp_path / "tmp").mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _refused(path, capsys, why: str) -> str:
    used = private_folder(str(path), what="test dumps")
    err = capsys.readouterr().err
    assert used != str(path)
    assert os.path.isdir(used) and not os.path.islink(used) and _mode(used) == 0o700
    assert os.lstat(used).st_uid == os.geteuid() and os.path.dirname(used) == tempfile.gettempdir()
    assert f"not using {path}: {why}" in err and used in err and "test dumps" in err, err
    return used


def test_a_missing_folder_is_created_0700_with_its_parents_whatever_the_umask(tmp_path, loose_umask):
    folder = tmp_path / "a" / "b"
    assert private_folder(str(folder), what="test dumps") == str(folder)
    assert _mode(folder) == 0o700 and _mode(tmp_path / "a") == 0o700
    os.umask(0o777)  # would leave the folder unusable if the mode were left to it
    other = tmp_path / "c"
    assert private_folder(str(other), what="test dumps") == str(other) and _mode(other) == 0o700


def test_an_own_folder_is_used_and_narrowed(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    os.chmod(folder, 0o755)  # what the flight recorder used to make
    assert private_folder(str(folder), what="test dumps") == str(folder)
    assert _mode(folder) == 0o700


def test_a_symlink_at_the_folder_path_is_not_followed(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    os.chmod(victim, 0o755)
    planted = tmp_path / "dumps"
    planted.symlink_to(victim)
    used = _refused(planted, capsys, "it is a symbolic link")
    assert _mode(victim) == 0o755 and not os.listdir(victim)  # neither changed nor written
    # The same fallback for that path while it stays private: dumps of one process stay together.
    assert private_folder(str(planted), what="test dumps") == used


def test_a_symlink_to_a_missing_folder_is_not_followed(tmp_path, capsys):
    planted = tmp_path / "dumps"
    planted.symlink_to(tmp_path / "not-yet")
    _refused(planted, capsys, "it is a symbolic link")
    assert not (tmp_path / "not-yet").exists()


def test_another_users_folder_is_refused(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    nobody = pwd.getpwnam("nobody").pw_uid
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, nobody, -1)
    _refused(folder, capsys, f"it is owned by uid {nobody}")
    assert os.lstat(folder).st_uid == nobody and _mode(folder) == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777])
def test_a_folder_others_can_write_in_is_refused(tmp_path, capsys, mode):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, mode)
    _refused(folder, capsys, "it is writable by others")
    assert _mode(folder) == mode  # left as it was: others may have planted something in it


def test_a_file_at_the_folder_path_is_refused(tmp_path, capsys):
    (tmp_path / "dumps").write_text("x")
    _refused(tmp_path / "dumps", capsys, "it is not a directory")


def test_a_new_file_is_0600_whatever_the_umask(tmp_path, loose_umask):
    with create_private_file(str(tmp_path / "f.json")) as f:
        f.write("{}")
    assert _mode(tmp_path / "f.json") == 0o600
    os.umask(0o277)
    with create_private_file(str(tmp_path / "g.bin"), "wb") as f:
        f.write(b"x")
    assert _mode(tmp_path / "g.bin") == 0o600


def test_a_symlink_at_the_file_path_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "f.json").symlink_to(victim)
    (tmp_path / "dangling.json").symlink_to(tmp_path / "would-be-created")
    for planted in ("f.json", "dangling.json"):
        with pytest.raises(OSError):
            create_private_file(str(tmp_path / planted))
    assert victim.read_text() == "precious" and not (tmp_path / "would-be-created").exists()
    with pytest.raises(FileExistsError):
        create_private_file(str(victim))  # an existing file is never reopened
    assert victim.read_text() == "precious"


def test_a_rewritten_file_replaces_a_planted_symlink_instead_of_writing_through_it(tmp_path, loose_umask):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "dump.json"
    target.symlink_to(victim)
    write_private_file(str(target), '{"a": 1}')
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_text() == '{"a": 1}' and _mode(target) == 0o600
    write_private_file(str(target), b"2")  # a rewrite replaces it again
    assert target.read_bytes() == b"2"
    assert sorted(os.listdir(tmp_path)) == ["dump.json", "tmp", "victim.txt"]  # no temporary left behind
