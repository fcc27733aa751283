"""The testbed's root commands trust nothing they did not make (issue 41, row 6), checked without
building hosts: one name pattern refuses shell metacharacters before anything runs, the testbed's
folder is refused when it is a link or writable by others, and the ssh stand-in refuses a state
path outside the testbed's folder and a name that is not a testbed host, starting nothing."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from ddl_triton.testbed import hosts as hosts_mod, ssh, state


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if anything is started or exec'd (a subprocess, nsenter, the relay's socket)."""
    started = []

    def refuse(*args, **kwargs):
        started.append(args)
        raise AssertionError(f"something ran: {args!r}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(os, "execvp", refuse)
    monkeypatch.setattr(ssh, "_run", refuse, raising=False)
    return started


@pytest.mark.parametrize("bad", ["h1;touch /tmp/pwned", "dt$(id)", "a b", "../x", "", "H1", "toolongname", 7])
def test_one_pattern_refuses_every_name_that_is_not_a_plain_short_word(bad, nothing_runs):
    with pytest.raises(ValueError, match=r"is not a testbed name: 1-6 lowercase letters and digits"):
        state.check_name(bad, "host")
    if isinstance(bad, str) and bad:
        with pytest.raises(ValueError, match=r"ddl-testbed: testbed .* is not a testbed name"):
            hosts_mod.Testbed(hosts=2, rate="", name=bad)
    assert not nothing_runs


def test_a_testbed_names_its_hosts_with_the_same_pattern():
    bed = hosts_mod.Testbed(hosts=3, rate="", name="dtok1")
    assert all(state.check_name(h, "host") == h for h in bed.hosts + [bed.name])
    with pytest.raises(ValueError, match="no running host 'h1;touch /tmp/pwned'"):
        bed.command("h1;touch /tmp/pwned", ["true"])


def _plant(tmp_path, holders: dict) -> str:
    """A state file outside the testbed's folder, as an attacker would plant it; returns the
    "testbed name" that points at it from the testbed's folder."""
    planted = tmp_path / "evil.json"
    planted.write_text(json.dumps({"name": "dtevil", "hosts": ["h1", "h2"], "rate": "", "holders": holders,
                                   "started": {}, "made": [], "run_dir": True, "owner": None, "relay": None}))
    return os.path.relpath(str(tmp_path / "evil"), str(state.STATE_DIR))


def test_the_ssh_stand_in_refuses_a_state_path_outside_the_testbeds_folder(tmp_path, monkeypatch, capsys, nothing_runs):
    inside = tmp_path / "inside.json"
    inside.write_text(json.dumps({"testbed": _plant(tmp_path, {"h2": 1}), "host": "h1"}))
    monkeypatch.setattr(ssh, "INSIDE_STATE", str(inside))
    monkeypatch.setattr(hosts_mod, "INSIDE_STATE", str(inside))
    assert ssh.main(["-x", "h2", "touch /tmp/pwned"]) == 255
    assert "is not a testbed name" in capsys.readouterr().err
    assert not nothing_runs


def test_the_ssh_stand_in_refuses_a_host_that_is_not_a_testbed_name(tmp_path, monkeypatch, capsys, nothing_runs):
    inside = tmp_path / "inside.json"
    inside.write_text(json.dumps({"testbed": "dtx", "host": "h1"}))
    monkeypatch.setattr(ssh, "INSIDE_STATE", str(inside))
    for host in ("h1;touch /tmp/pwned", "../h2", "h2 && reboot"):
        assert ssh.main([host, "true"]) == 255
        assert "is not a testbed name" in capsys.readouterr().err
    assert not nothing_runs


def test_a_state_file_that_names_other_namespaces_or_processes_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "STATE_DIR", tmp_path)
    good = {"name": "dtq", "hosts": ["h1", "h2"], "rate": "", "holders": {"h1": 5}, "started": {"h1": 9},
            "made": ["dtq-sw", "dtq-h1"], "run_dir": True, "owner": None, "relay": None}
    (tmp_path / "dtq.json").write_text(json.dumps(good))
    assert state.read_state("dtq")["made"] == ["dtq-sw", "dtq-h1"]
    for change in ({"made": ["dtq-sw", "prod-db"]}, {"hosts": ["h1", "x;y"]}, {"holders": {"h1": "1; rm"}},
                   {"name": "other"}, {"relay": ["1"]}):
        (tmp_path / "dtq.json").write_text(json.dumps(dict(good, **change)))
        with pytest.raises(ValueError, match="is not a testbed's state"):
            state.read_state("dtq")
    os.unlink(tmp_path / "dtq.json")
    os.symlink(tmp_path / "elsewhere.json", tmp_path / "dtq.json")  # never followed
    with pytest.raises(ValueError, match="cannot read"):
        state.read_state("dtq")


@pytest.mark.skipif(os.geteuid() != 0, reason="the testbed's folder must be owned by root")
def test_the_testbeds_folder_is_refused_when_a_link_or_writable_by_others_and_made_0700(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    monkeypatch.setattr(state, "STATE_DIR", tmp_path / "link")
    os.symlink(real, tmp_path / "link")
    with pytest.raises(RuntimeError, match="refusing .*link"):
        state.state_folder()
    monkeypatch.setattr(state, "STATE_DIR", real)
    os.chmod(real, 0o777)
    with pytest.raises(RuntimeError, match="writable by others"):
        state.state_folder()
    os.chmod(real, 0o755)  # an earlier version's mode: nobody else could write; narrowed
    assert state.state_folder() == real and (os.stat(real).st_mode & 0o777) == 0o700
    monkeypatch.setattr(state, "STATE_DIR", tmp_path / "fresh")
    assert (os.stat(state.state_folder()).st_mode & 0o777) == 0o700
