"""Where the flight recorder and the tracer write (issue 41, row 3): a link another local user
planted at the default dump folder, or at a dump's or a trace's file name, is never followed; the
dump lands in a private place, and the message names it. The default folder holds a folder per job
(issue 51, item 4), so that `trace why` never reads dumps of two jobs as one."""
from __future__ import annotations

import atexit
import os
import stat
import tempfile

import pytest

from ddl_triton.observability import flight
from ddl_triton.observability.tracer import Tracer


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def tmpdir_(tmp_path, monkeypatch):
    """$TMPDIR, as the recorder sees it, in the test's folder; a loose umask, as a user may have."""
    folder = tmp_path / "tmp"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    old = os.umask(0o022)
    yield folder
    os.umask(old)


JOB = "20260314-101502-9f3c2a7e"


def _recorder(dump_dir: str = "", job: str = JOB, rank: int = 3) -> flight.FlightRecorder:
    recorder = flight.FlightRecorder(capacity=10)
    recorder.configure(rank=rank, size=4, capacity=10, dump_dir=dump_dir)
    recorder.job = job  # as init's agreement sets it (ddl_triton/runtime/setup/job_id.py)
    return recorder


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    os.chmod(victim, 0o755)
    (victim / "precious").write_text("keep")
    return victim


def _victim_intact(victim) -> bool:
    return sorted(os.listdir(victim)) == ["precious"] and (victim / "precious").read_bytes() == b"keep" \
        and _mode(victim) == 0o755


def test_the_default_dump_folder_is_a_folder_per_job_made_0700_and_the_dump_0600(tmpdir_):
    path = _recorder().dump("test")
    assert path == os.path.join(flight.default_dump_dir(), JOB, "flight-rank3.json")
    assert os.path.dirname(path) == str(tmpdir_ / f"ddl_triton-flight-{os.getuid()}" / JOB)
    assert _mode(os.path.dirname(path)) == 0o700 and _mode(os.path.dirname(os.path.dirname(path))) == 0o700
    assert _mode(path) == 0o600
    other = _recorder(job="20260314-101503-00aa11bb").dump("test")  # another job's rank 3: beside, not over it
    assert os.path.dirname(other) != os.path.dirname(path) and os.path.exists(path)


def test_a_symlink_planted_at_a_job_folder_is_not_followed(tmp_path, tmpdir_, capsys):
    victim = _victim(tmp_path)
    user_folder = tmpdir_ / f"ddl_triton-flight-{os.getuid()}"
    user_folder.mkdir(mode=0o700)
    (user_folder / JOB).symlink_to(victim)
    path = _recorder().dump("test")
    assert path and _victim_intact(victim)
    assert f"not using {user_folder / JOB}: it is a symbolic link" in capsys.readouterr().err
    assert _mode(os.path.dirname(path)) == 0o700 and _mode(path) == 0o600


def test_a_symlink_planted_at_the_default_dump_folder_is_not_followed(tmp_path, tmpdir_, capsys):
    victim = _victim(tmp_path)
    planted = tmpdir_ / f"ddl_triton-flight-{os.getuid()}"
    planted.symlink_to(victim)
    path = _recorder().dump("test")
    err = capsys.readouterr().err
    assert path and _victim_intact(victim), (path, os.listdir(victim))
    folder = os.path.dirname(os.path.dirname(path))  # the job's folder is made in the fallback
    assert folder != str(planted) and os.path.dirname(folder) == str(tmpdir_)
    assert _mode(folder) == 0o700 and os.lstat(folder).st_uid == os.geteuid() and _mode(path) == 0o600
    assert f"not using {planted}: it is a symbolic link; using {folder} instead" in err, err
    assert "rank 3: flight-recorder dumps" in err


def test_a_default_dump_folder_others_can_write_in_is_not_used(tmp_path, tmpdir_, capsys):
    planted = tmpdir_ / f"ddl_triton-flight-{os.getuid()}"
    planted.mkdir()
    os.chmod(planted, 0o777)
    path = _recorder().dump("test")
    assert path and not os.listdir(planted) and os.path.dirname(path) != str(planted)
    assert "it is writable by others" in capsys.readouterr().err


def test_symlinks_planted_at_the_dump_file_names_are_not_followed(tmp_path, tmpdir_):
    victim = _victim(tmp_path)
    dumps = tmp_path / "dumps"  # a folder the user named (DDL_DUMP_DIR)
    dumps.mkdir()
    final = dumps / "flight-rank3.json"
    final.symlink_to(victim / "precious")
    # The names the old recorder wrote through before renaming: <final>.<pid>.tmp.
    (dumps / f"flight-rank3.json.{os.getpid()}.tmp").symlink_to(victim / "precious")
    path = _recorder(str(dumps)).dump("test")
    assert path == str(final) and _victim_intact(victim)
    assert not final.is_symlink() and _mode(final) == 0o600 and '"reason": "test"' in final.read_text()


def test_a_missing_user_dump_folder_is_made_0700(tmp_path, tmpdir_):
    path = _recorder(str(tmp_path / "a" / "dumps")).dump("test")
    assert path == str(tmp_path / "a" / "dumps" / "flight-rank3.json")
    assert _mode(tmp_path / "a" / "dumps") == 0o700 and _mode(tmp_path / "a") == 0o700 and _mode(path) == 0o600


def test_symlinks_planted_at_the_trace_file_names_are_not_followed(tmp_path, tmpdir_):
    victim = _victim(tmp_path)
    folder = tmp_path / "trace"
    folder.mkdir()
    final = folder / "trace-rank1.json"
    final.symlink_to(victim / "precious")
    (folder / f"trace-rank1.json.{os.getpid()}.tmp").symlink_to(victim / "precious")
    tracer = Tracer(str(folder), 1, 2)
    atexit.unregister(tracer.flush)  # flushed here, not when pytest exits
    tracer.span("allreduce #1", tracer.now(), tracer.now() + 5)
    assert tracer.flush() == str(final)
    assert _victim_intact(victim)
    assert not final.is_symlink() and _mode(final) == 0o600 and "allreduce #1" in final.read_text()


def test_a_missing_trace_folder_is_made_0700(tmp_path, tmpdir_):
    tracer = Tracer(str(tmp_path / "trace"), 0, 1)
    atexit.unregister(tracer.flush)
    assert tracer.flush() == str(tmp_path / "trace" / "trace-rank0.json")
    assert _mode(tmp_path / "trace") == 0o700 and _mode(tmp_path / "trace" / "trace-rank0.json") == 0o600


def test_the_merged_timeline_and_a_plot_replace_a_planted_symlink(tmp_path, tmpdir_):
    from ddl_triton.observability import trace_command

    victim = _victim(tmp_path)
    tracer = Tracer(str(tmp_path / "trace"), 0, 1)
    atexit.unregister(tracer.flush)
    tracer.span("allreduce #1", tracer.now(), tracer.now() + 5)
    tracer.flush()
    out, png = tmpdir_ / "job.json", tmpdir_ / "job.png"
    out.symlink_to(victim / "precious")
    png.symlink_to(victim / "precious")
    assert trace_command.main(["merge", str(tmp_path / "trace"), "-o", str(out)]) == 0
    pytest.importorskip("matplotlib")
    trace_command.main(["plot", str(tmp_path / "trace"), "-o", str(png)])
    assert _victim_intact(victim)
    assert not out.is_symlink() and "allreduce #1" in out.read_text() and _mode(out) == 0o600
    assert not png.is_symlink() and png.read_bytes().startswith(b"\x89PNG") and _mode(png) == 0o600
