"""What `ckptfs status`, `umount` and `prefetch` show a person (ckptfs/ui.py), on real mounts.

  * `status` without a terminal: plain text (no escape codes, no carriage returns, no box
    drawing), one line per set whatever its path's length, the sets with their states and sizes
    as written, the data at risk while the store holds uploads back, and none after `wait`.
  * `status --json`: the daemon's reply, keys and layout as `json.dumps(api.status())` (what
    the command printed before ckptfs/ui.py existed).
  * `status --watch` on a pseudo-terminal redraws in place as the mount changes and exits 0 on
    SIGINT; it exits with status's code when the mount goes away.
  * `umount` and `prefetch` on a pseudo-terminal draw a rich progress bar, held at 0% by a gate
    in front of the store until the test has seen it, then finish with their one-line result
    on stdout; without a terminal they print plain progress lines.
  * A reader that goes away (`ckptfs status | head -1`) and a terminal 12 columns wide end
    without a traceback.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pty
import re
import shlex
import signal
import struct
import subprocess
import termios
import threading
from pathlib import Path

import pytest
from rich.console import Console

import ckptfs
from ckptfs import ui
from ckptfs.mount import EXIT_MOUNTPOINT, EXIT_OK, EXIT_STORE, EXIT_USAGE
from tests.conftest import REPO, ckptfs_cmd, is_mounted, run_cli, wait_for

MiB = 1 << 20
ESC = "\x1b"
BAR = "━"  # rich's BarColumn draws with U+2501


# ----------------------------------------------------------------------------------------------
# helpers


def term_env() -> dict:
    """The environment of a command run on a terminal (or not): no colour overrides."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "LINES", "TTY_COMPATIBLE",
                        "TTY_INTERACTIVE", "CKPTFS_FAULTS")}
    env["TERM"] = "xterm-256color"
    return env


class Reader(threading.Thread):
    """Collects everything written to `fd` (a pipe or a pty master) until EOF."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.buf = b""
        self.lock = threading.Lock()
        self.start()

    def run(self) -> None:
        while True:
            try:
                d = os.read(self.fd, 65536)
            except OSError:  # EIO: the pty's last slave fd closed
                break
            if not d:
                break
            with self.lock:
                self.buf += d
        os.close(self.fd)

    def text(self) -> str:
        with self.lock:
            return self.buf.decode(errors="replace")


@contextlib.contextmanager
def _default_sigint():
    """Children started inside get SIGINT as a terminal's Ctrl-C finds it. A suite started in
    the background by a non-interactive shell inherits SIGINT ignored, which a child keeps
    across exec, and a Python started so keeps ignoring it (POSIX: a background job is not
    interrupted): the tests that send SIGINT would wait for nothing."""
    old = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


class Run:
    """A `ckptfs` command whose stderr (and stdout unless `stdout_tty=False`) is a pseudo-
    terminal `cols` wide, or, with `tty=False`, pipes. `.tty` collects the terminal's output,
    `.out` and `.err` the pipes'."""

    def __init__(self, *args: str, tty: bool = True, stdout_tty: bool = True,
                 cols: int = 120) -> None:
        with _default_sigint():
            self._start(args, tty, stdout_tty, cols)

    def _start(self, args: tuple[str, ...], tty: bool, stdout_tty: bool, cols: int) -> None:
        self.tty = self.out = self.err = None
        if tty:
            master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, cols, 0, 0))
            out_r = None
            if stdout_tty:
                stdout = slave
            else:
                out_r, stdout = os.pipe()
            self.proc = subprocess.Popen(ckptfs_cmd(*args), stdin=slave, stdout=stdout,
                                         stderr=slave, cwd=REPO, env=term_env(),
                                         start_new_session=True)
            os.close(slave)
            if out_r is not None:
                os.close(stdout)
                self.out = Reader(out_r)
            self.tty = Reader(master)
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            self.proc = subprocess.Popen(ckptfs_cmd(*args), stdin=subprocess.DEVNULL,
                                         stdout=out_w, stderr=err_w, cwd=REPO, env=term_env())
            os.close(out_w)
            os.close(err_w)
            self.out, self.err = Reader(out_r), Reader(err_r)

    def wait(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout=timeout)
        for r in (self.tty, self.out, self.err):
            if r is not None:
                r.join(timeout)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def runs():
    """Run(...) that is killed at the end of the test if it is still running."""
    made: list[Run] = []

    def make(*args, **kw) -> Run:
        r = Run(*args, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.kill()


def held(gate: Path, ops: tuple[str, ...]) -> str:
    """CKPTFS_FAULTS for a daemon whose store calls `ops` on data objects wait while `gate`
    exists (tests/faultstore.py FaultyStore.hold)."""
    gate.touch()
    return ",".join(f"{op}@data/=hold:{gate}" for op in ops)


UPLOADS = ("put", "create_multipart", "upload_part")


def start_held(m, gate: Path, ops: tuple[str, ...], monkeypatch, *extra: str) -> None:
    monkeypatch.setenv("CKPTFS_FAULTS", held(gate, ops))  # the daemon inherits it
    try:
        m.start(*extra)
    finally:
        monkeypatch.delenv("CKPTFS_FAULTS")


def tiering(m) -> dict:
    return ckptfs.status(m.path)["tiering"]


def set_row(m, path: str) -> dict | None:
    rows = [s for s in tiering(m)["sets"] if s["path"] == path]
    return rows[-1] if rows else None


def status_text(m) -> str:
    res = run_cli("status", str(m.path))
    assert res.returncode == EXIT_OK and res.stderr == "", res.stderr
    assert ESC not in res.stdout and "\r" not in res.stdout, repr(res.stdout)
    assert not set(res.stdout) & set("─━│┃┌┐└┘├┤┬┴┼╭╮╯╰"), res.stdout  # no box drawing
    return res.stdout


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def line_of(text: str, start: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith(start)]
    assert len(lines) == 1, (start, text)
    return lines[0]


def set_line(text: str, path: str) -> list[str]:
    """The words of the sets-table line of `path` (set, state, files, size, uploaded: size and
    uploaded are two words each, '4.0 MiB') up to the path, which must end the line whole."""
    lines = [ln for ln in text.splitlines() if ln.endswith("  " + path)]
    assert len(lines) == 1, (path, text)
    return lines[0][: -len(path)].split()


def write(path: Path, n: int, seed: int) -> bytes:
    data = (bytes([seed]) * 4093 + os.urandom(3))[:4096] * (n // 4096) + b"x" * (n % 4096)
    path.write_bytes(data)
    return data


# ----------------------------------------------------------------------------------------------
# status, plain


def test_status_shows_sets_and_the_data_at_risk(mount_factory, tmp_path, monkeypatch):
    gate = tmp_path / "uploads-held"
    m = mount_factory()
    start_held(m, gate, UPLOADS, monkeypatch)
    # A directory set of two files (renamed into place), and a file set with a long path.
    tmp = m.path / "ck" / "step_1.tmp"
    tmp.mkdir(parents=True)
    sizes = {"__0_0.distcp": 3 * MiB + 5, "__1_0.distcp": MiB}
    for i, (name, n) in enumerate(sizes.items()):
        write(tmp / name, n, i)
    os.rename(tmp, m.path / "ck" / "step_1")
    deep = m.path / ("a" * 120) / ("b" * 120) / ("c" * 120)
    deep.mkdir(parents=True)
    write(deep / "model.pt", 2 * MiB, 7)
    long_path = str((deep / "model.pt").relative_to(m.path))
    assert len(long_path) > 360
    wait_for(lambda: set_row(m, "ck/step_1") and set_row(m, long_path), timeout=30,
             what="both sets committed")
    total = sum(sizes.values())

    text = status_text(m)
    assert f"pid {m.pid}" in line_of(text, "mount ")
    assert "3 files" in line_of(text, "cache dir ") and "disk free" in text
    assert f"file://{m.store_dir}: normal" in line_of(text, "store ")
    assert "; conditional writes honoured (If-None-Match, If-Match" in line_of(text, "store ")
    assert tiering(m)["store"]["conditional_writes"]["honoured"] is True
    # which client moves the bytes (docs/ARCHITECTURE.md "Store data path"): file:// is the
    # kernel's copy
    assert "; data bytes by the kernel (file://)" in line_of(text, "store ")
    assert tiering(m)["store"]["data_path"] == "local"
    # Nothing is durable: both sets, all their bytes, are at risk.
    risk = line_of(text, "at risk ")
    assert f"{ui.human(total + 2 * MiB)} in 2 sets committed but not yet durable" in risk, risk
    age = re.search(r"the oldest committed (\d+)s ago", risk)
    assert age and int(age.group(1)) < 120, risk
    assert tiering(m)["pending_bytes"] == total + 2 * MiB
    words = set_line(text, "ck/step_1")
    assert words[1] in ("committed", "uploading") and words[2] == "2", words
    assert " ".join(words[3:5]) == ui.human(total) and " ".join(words[5:7]) == "0 B", words
    # The long path is whole on one line (grep finds the set by it), with its state and size.
    words = set_line(text, long_path)
    assert words[1] in ("committed", "uploading") and " ".join(words[3:5]) == "2.0 MiB", words

    gate.unlink()  # the store takes the uploads
    for p in ("ck/step_1", long_path):
        res = run_cli("wait", str(m.path / p), "--timeout", "120")
        assert res.returncode == EXIT_OK, res.stderr
    text = status_text(m)
    assert "0 B in 0 sets: every committed set is durable" in line_of(text, "at risk "), text
    words = set_line(text, "ck/step_1")
    assert words[1] == "durable" and " ".join(words[5:7]) == ui.human(total), words
    assert set_line(text, long_path)[1] == "durable"
    assert tiering(m)["pending_bytes"] == 0
    m.stop()
    assert not m.unexpected_errors()


def test_status_escapes_control_characters_in_names(mnt):
    name = "evil\x1b[2J\nname.pt"
    (mnt.path / name).write_bytes(b"x" * 1000)
    wait_for(lambda: set_row(mnt, name), timeout=30, what="the set")
    text = status_text(mnt)  # no escape code: asserted there
    words = set_line(text, "evil\\x1b[2J\\x0aname.pt")
    assert words[2] == "1", words


def test_status_json_is_the_daemons_reply(mnt):
    (mnt.path / "f.pt").write_bytes(b"y" * 5000)
    assert run_cli("wait", str(mnt.path / "f.pt"), "--timeout", "60").returncode == 0
    res = run_cli("status", str(mnt.path), "--json")
    assert res.returncode == EXIT_OK, res.stderr
    # What `status --json` printed before ckptfs/ui.py: json.dumps(api.status(mp), indent=2,
    # sort_keys=True). Values move (uptime, disk free); the keys, nesting and layout do not.
    before = json.dumps(ckptfs.status(mnt.path), indent=2, sort_keys=True)

    def keys(v):
        if isinstance(v, dict):
            return {k: keys(x) for k, x in v.items()}
        if isinstance(v, list):
            return [keys(x) for x in v]
        return "."  # a value: it may move between the two calls

    def skeleton(text: str) -> list[str]:
        return [re.sub(r":.*", ":", ln) for ln in text.splitlines()]

    got = json.loads(res.stdout)
    assert keys(got) == keys(json.loads(before))
    assert skeleton(res.stdout) == skeleton(before)
    assert res.stdout == json.dumps(got, indent=2, sort_keys=True) + "\n"
    assert got["tiering"]["sets"][-1]["path"] == "f.pt"


def test_status_usage_errors(mnt):
    for args, what in ((["--watch", "0", str(mnt.path)], "--watch"),
                       ([str(mnt.path), "--watch", "x"], "--watch"),
                       ([str(mnt.path), "--watch", "--json"], "not allowed"),
                       (["--watch"], "mountpoint"),
                       ([], "mountpoint")):
        res = run_cli("status", *args)
        assert res.returncode == EXIT_USAGE, (args, res.stderr)
        assert res.stderr.startswith("ckptfs: ") and what in res.stderr, (args, res.stderr)
        assert len(res.stderr.splitlines()) == 1 and res.stdout == "", (args, res.stderr)


# ----------------------------------------------------------------------------------------------
# status --watch


def test_status_watch_redraws_on_a_terminal_and_exits_0_on_sigint(mnt, runs):
    # wide enough for the header with the whole mount path (a worker's tmp path is longer)
    w = runs("status", str(mnt.path), "--watch", "0.2", cols=240)
    wait_for(lambda: "0 files" in w.tty.text(), timeout=30, what="the first page")
    (mnt.path / "a.pt").write_bytes(b"a" * 100)
    wait_for(lambda: "1 files" in w.tty.text(), timeout=30, what="a page with a.pt")
    (mnt.path / "b.pt").write_bytes(b"b" * 100)
    wait_for(lambda: "2 files" in w.tty.text(), timeout=30, what="a page with b.pt")
    out = w.tty.text()
    assert out.count(f"pid {mnt.pid}") >= 3, out  # three pages at least
    assert f"{ESC}[" in out and "Ctrl-C to stop" in out
    assert re.search(r"\x1b\[\d*A", out), "no cursor-up: the page was not redrawn in place"
    os.kill(w.proc.pid, signal.SIGINT)
    assert w.wait() == EXIT_OK, w.tty.text()
    assert "Traceback" not in w.tty.text() and "interrupted" not in w.tty.text()


def test_status_watch_ends_with_status_code_when_the_mount_goes_away(mount_factory, runs):
    m = mount_factory()
    m.start()
    w = runs("status", "--watch", str(m.path))  # default interval; MOUNTPOINT after --watch
    wait_for(lambda: f"pid {m.pid}" in w.tty.text(), timeout=30, what="the first page")
    m.stop()
    assert w.wait() == EXIT_MOUNTPOINT, w.tty.text()
    last = strip_ansi(w.tty.text()).rstrip().splitlines()[-1]
    assert last.startswith("ckptfs: ") and "not inside a ckptfs mount" in last, last
    assert "Traceback" not in w.tty.text()


def test_status_watch_without_a_terminal_prints_plain_pages(mnt, runs):
    w = runs("status", str(mnt.path), "--watch", "0.2", tty=False)
    wait_for(lambda: w.out.text().count(f"pid {mnt.pid}") >= 2, timeout=30,
             what="two pages")
    os.kill(w.proc.pid, signal.SIGINT)
    assert w.wait() == EXIT_OK, w.err.text()
    out = w.out.text()
    assert ESC not in out and "\r" not in out, repr(out)
    assert w.err.text() == ""


# ----------------------------------------------------------------------------------------------
# progress: umount and prefetch


def test_umount_draws_a_progress_bar_on_a_terminal(mount_factory, tmp_path, monkeypatch, runs):
    gate = tmp_path / "uploads-held"
    m = mount_factory()
    start_held(m, gate, UPLOADS, monkeypatch, "--part-size", "5M")
    write(m.path / "big.pt", 12 * MiB, 1)
    wait_for(lambda: set_row(m, "big.pt"), timeout=30, what="the set")
    u = runs("umount", str(m.path), stdout_tty=False)
    # The bar is up while the store holds every upload back.
    wait_for(lambda: BAR in u.tty.text() and "12.0 MiB" in u.tty.text(), timeout=30,
             what="the progress bar")
    shown = u.tty.text()
    assert "uploads" in shown and "0%" in shown and "1 set pending" in shown, shown
    assert "store normal" in shown and ESC in shown
    assert u.proc.poll() is None  # still draining
    gate.unlink()
    assert u.wait() == EXIT_OK, u.tty.text()
    m.pid = None
    assert u.out.text() == f"ckptfs: unmounted {m.path}\n"
    assert "100%" in u.tty.text() and "Traceback" not in u.tty.text()


def test_umount_without_a_terminal_prints_plain_progress(mount_factory, tmp_path, monkeypatch,
                                                         runs):
    gate = tmp_path / "uploads-held"
    m = mount_factory()
    start_held(m, gate, UPLOADS, monkeypatch)
    write(m.path / "big.pt", 6 * MiB, 2)
    wait_for(lambda: set_row(m, "big.pt"), timeout=30, what="the set")
    u = runs("umount", str(m.path), tty=False)
    wait_for(lambda: "\n" in u.err.text(), timeout=30, what="the first progress line")
    gate.unlink()
    assert u.wait() == EXIT_OK, u.err.text()
    m.pid = None
    assert u.out.text() == f"ckptfs: unmounted {m.path}\n"
    err = u.err.text()
    assert ESC not in err and "\r" not in err, repr(err)
    lines = err.splitlines()
    assert lines[0].startswith("uploads: 0 B of 6.0 MiB (0%), 1 set pending"), lines
    assert lines[-1] == "uploads: 6.0 MiB of 6.0 MiB (100%): all sets durable", lines


@pytest.fixture
def cold_pair(mount_factory, tmp_path, monkeypatch):
    """(A, B, gate, sets): node A wrote two durable sets; node B, on A's store with an empty
    cache, shows them and fetches data objects only while `gate` does not exist (it does)."""
    a = mount_factory("a")
    a.start()
    sets = {}
    for k in (1, 2):
        tmp = a.path / "ck" / f"step_{k}.tmp"
        tmp.mkdir(parents=True)
        sets[f"ck/step_{k}"] = {n: write(tmp / n, size, k * 10 + i) for i, (n, size) in
                                enumerate((("__0_0.distcp", 5 * MiB + 3), (".metadata", 700)))}
        os.rename(tmp, a.path / "ck" / f"step_{k}")
        res = run_cli("wait", str(a.path / "ck" / f"step_{k}"), "--timeout", "120")
        assert res.returncode == EXIT_OK, res.stderr
    gate = tmp_path / "gets-held"
    b = mount_factory("b")
    start_held(b, gate, ("get",), monkeypatch, "--store", f"file://{a.store_dir}",
               "--no-prefetch")
    wait_for(lambda: all((b.path / p).is_dir() for p in sets), timeout=30,
             what="the sets on node B")
    return a, b, gate, sets


def test_prefetch_draws_a_progress_bar_and_without_a_terminal_plain_lines(cold_pair, runs):
    _a, b, gate, sets = cold_pair
    size = sum(len(v) for v in sets["ck/step_1"].values())
    p = runs("prefetch", str(b.path / "ck" / "step_1"), stdout_tty=False)
    wait_for(lambda: BAR in p.tty.text() and "prefetch ck/step_1" in p.tty.text(), timeout=30,
             what="the progress bar")
    shown = p.tty.text()
    assert "2 files" in shown and ui.human(size) in shown and ESC in shown, shown
    assert p.proc.poll() is None  # held
    gate.unlink()
    assert p.wait() == EXIT_OK, p.tty.text()
    assert re.fullmatch(rf"ckptfs: prefetched ck/step_1: 2 files, "
                        rf"{re.escape(ui.human(size))} in \d+\.\ds\n", p.out.text()), p.out.text()
    assert "100%" in p.tty.text() and "Traceback" not in p.tty.text()
    for name, data in sets["ck/step_1"].items():
        assert (b.path / "ck" / "step_1" / name).read_bytes() == data

    gate.touch()  # hold again: the second set, without a terminal
    q = runs("prefetch", str(b.path / "ck" / "step_2"), tty=False)
    wait_for(lambda: "\n" in q.err.text(), timeout=30, what="the first progress line")
    gate.unlink()
    assert q.wait() == EXIT_OK, q.err.text()
    err = q.err.text()
    assert ESC not in err and "\r" not in err, repr(err)
    lines = err.splitlines()
    assert lines[0].startswith(f"prefetch ck/step_2: 0 B of {ui.human(size)} (0%), 2 files"), \
        lines
    assert lines[-1].startswith(f"prefetch ck/step_2: {ui.human(size)} of {ui.human(size)} "
                                "(100%), 2 files"), lines
    assert q.out.text().startswith("ckptfs: prefetched ck/step_2: 2 files")
    assert len(q.out.text().splitlines()) == 1


# ----------------------------------------------------------------------------------------------
# no traceback: a closed pipe, a narrow terminal


def test_a_reader_that_goes_away_gets_no_traceback(mnt):
    (mnt.path / "f.pt").write_bytes(b"f" * 10)
    for args in ([], ["--json"]):
        r, w = os.pipe()
        os.close(r)  # the reader is gone before the first write: EPIPE
        res = subprocess.run(ckptfs_cmd("status", str(mnt.path), *args), stdout=w,
                             stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=60, check=False)
        os.close(w)
        assert res.returncode == EXIT_OK and res.stderr == "", (args, res.stderr)
    # `status --watch | head -1`: head exits after a line, the next page meets a closed pipe.
    cmd = shlex.join(ckptfs_cmd("status", str(mnt.path), "--watch", "0.1"))
    res = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd} | head -1"],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert res.returncode == EXIT_OK and res.stderr == "", res.stderr
    assert res.stdout.startswith("ckptfs status ") and len(res.stdout.splitlines()) == 1


def test_umount_with_a_closed_stderr_still_unmounts(mount_factory, tmp_path, monkeypatch):
    """Progress and the timeout error meet a closed stderr: the unmount goes on, and the exit
    code still says what happened (7: uploads were pending at the timeout). A traceback, or
    the interpreter's failed final flush, would exit 1 or 120."""
    gate = tmp_path / "uploads-held"
    m = mount_factory()
    start_held(m, gate, UPLOADS, monkeypatch)
    write(m.path / "big.pt", 2 * MiB, 3)
    wait_for(lambda: set_row(m, "big.pt"), timeout=30, what="the set")
    r, w = os.pipe()
    os.close(r)
    res = subprocess.run(ckptfs_cmd("umount", str(m.path), "--timeout", "1"), stderr=w,
                         stdout=subprocess.PIPE, text=True, cwd=REPO, timeout=120, check=False)
    os.close(w)
    assert res.returncode == EXIT_STORE and res.stdout == "", res
    wait_for(lambda: not is_mounted(m.path), timeout=30, what="the unmount")
    m.pid = None
    gate.unlink()
    m.start()  # the upload resumes at the next mount
    assert run_cli("wait", str(m.path / "big.pt"), "--timeout", "60").returncode == EXIT_OK


def test_a_narrow_terminal_gets_no_traceback(mnt, runs):
    name = "n" * 60
    (mnt.path / name).write_bytes(b"n" * 10)
    wait_for(lambda: set_row(mnt, name), timeout=30, what="the set")
    for cols in (12, 40):
        s = runs("status", str(mnt.path), cols=cols)
        assert s.wait() == EXIT_OK, s.tty.text()
        out = re.sub(r"\s+", "", strip_ansi(s.tty.text()))
        assert "Traceback" not in out and f"pid{mnt.pid}" in out, out
        if cols == 40:
            assert name in out, out  # folded over lines (the last column), not cut


def test_notes_invalid_manifests_and_jobs_render_plain_and_narrow(mnt):
    """In process, in addition to the real runs above: a real status reply, with the parts a
    single node cannot easily show (a set waiting for other nodes, one published after it, a
    failed one, invalid manifests) added, rendered plain and on a narrow terminal."""
    (mnt.path / "w.pt").write_bytes(b"w" * 10)
    wait_for(lambda: set_row(mnt, "w.pt"), timeout=30, what="the set")
    st = ckptfs.status(mnt.path)
    t = st["tiering"]
    row = t["sets"][-1]
    bad_key = "manifests/" + "k" * 300 + ".json"
    t["sets"] = [
        dict(row, state="committed", waiting_for={"files": ["__2_0.distcp"], "missing": 1,
                                                  "waited_s": 12.4, "timeout_s": 1800}),
        dict(row, seq=row["seq"] + 1, path="next.pt", state="committed",
             after_set=row["seq"]),
        dict(row, seq=row["seq"] + 2, path="bad.pt", state="failed", error="no room\nat all"),
    ]
    t["remote"]["invalid_manifests"] = {bad_key: "not JSON"}
    t["remote"]["invalid_count"] = 1
    t["restore"]["jobs"] = [{"path": "ck/x", "files": 2, "bytes_total": 3 * MiB,
                             "bytes_done": MiB, "finished": True, "error": "the cache is full"}]
    text = ui.plain(ui.status_view(st, fancy=False))
    assert ESC not in text
    lines = text.splitlines()
    i = lines.index(next(ln for ln in lines if ln.endswith("  w.pt")))
    assert lines[i + 1].strip() == ("waiting 12s (timeout 1800s) for 1 file(s) from other "
                                    "nodes: __2_0.distcp"), lines[i + 1]
    assert any(ln.endswith("  next.pt") for ln in lines)
    assert any(ln.strip() == f"published after set {row['seq']} (commit order)" for ln in lines)
    assert any(ln.endswith("bad.pt  (no room\\x0aat all)") and " failed " in ln for ln in lines)
    assert f"{bad_key}: not JSON" in lines, text
    assert any(ln.split()[:2] == ["1", "stopped"] and ln.endswith("ck/x  (the cache is full)")
               for ln in lines), text
    narrow = Console(file=io.StringIO(), width=30, color_system="truecolor", force_terminal=True)
    narrow.print(ui.status_view(st, fancy=True, width=30))
    out = re.sub(r"\s+", "", strip_ansi(narrow.file.getvalue()))
    for word in ("w.pt", "waiting12s", "publishedafterset", "bad.pt", bad_key, "ck/x"):
        assert word in out, (word, out)


def test_stuck_sets_render_plain_coloured_and_narrow(mnt):
    """In process, on a real status reply: the "stuck" row names the first 5 stuck sets (oldest
    first) with what each waits for and why, then "and N more"; absent when none is stuck. On
    a terminal it is yellow, red when one waits for something no wait will end; a narrow
    terminal folds it without a traceback. (A real stuck set: tests/mount/test_status.py.)"""
    (mnt.path / "s.pt").write_bytes(b"s" * 10)
    wait_for(lambda: set_row(mnt, "s.pt"), timeout=30, what="the set")
    st = ckptfs.status(mnt.path)
    t = st["tiering"]
    assert t["stuck_sets"] == 0 and t["stuck"] == [] and t["stuck_after_s"] == 120.0
    text = ui.plain(ui.status_view(st, fancy=False))
    assert not any(ln.startswith("stuck ") for ln in text.splitlines()), text

    def row(seq: int, path: str, waits_for: str, why: str) -> dict:
        return {"seq": seq, "path": path, "state": "uploading", "committed_ns": 1,
                "age_s": 754.2, "waits_for": waits_for, "why": why}

    t["stuck"] = [row(3, "ckpt/dcp_3", "uploads", "1 of 2 file(s) not in the store yet"),
                  row(4, "evil\nname", "commit_order", "published after set 3")]
    t["stuck"] += [row(10 + i, f"ckpt/s{i}.pt", "commit_order", "published after set 3")
                   for i in range(5)]
    t["stuck_sets"] = 9
    lines = ui.plain(ui.status_view(st, fancy=False)).splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("stuck "))
    assert lines[i] == "stuck      9 sets pending longer than 2m00s, oldest first:", lines[i]
    assert lines[i + 1].strip() == ("set 3 ckpt/dcp_3 (uploading 12m34s, uploads): 1 of 2 "
                                    "file(s) not in the store yet"), lines[i + 1]
    assert lines[i + 2].strip() == ("set 4 evil\\x0aname (uploading 12m34s, commit_order): "
                                    "published after set 3"), lines[i + 2]
    assert [ln.split()[1] for ln in lines[i + 3:i + 6]] == ["10", "11", "12"]
    assert lines[i + 6].strip() == "and 4 more (`ckptfs status --json` lists 7)", lines[i + 6]
    assert ESC not in "\n".join(lines)

    def coloured(width: int) -> str:
        con = Console(file=io.StringIO(), width=width, color_system="truecolor",
                      force_terminal=True)
        con.print(ui.status_view(st, fancy=True, width=width))
        return con.file.getvalue()

    yellow = coloured(200)
    assert "\x1b[1;33m9 sets pending longer than" in yellow, yellow
    t["stuck"][0] = row(3, "ckpt/dcp_3", "unknown", "NOTHING KNOWN: every file is uploaded")
    red = coloured(200)
    assert "\x1b[1;31m9 sets pending longer than" in red, red
    narrow = re.sub(r"\s+", "", strip_ansi(coloured(12)))
    assert "Traceback" not in narrow and "ckpt/dcp_3" in narrow and "NOTHINGKNOWN" in narrow

