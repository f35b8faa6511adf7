"""What the `ckptfs` command line shows a person: `status` (once, or `--watch`), and the progress
of `umount`'s drain and of `prefetch`, drawn with rich.

This module owns the look of the output, and the loops that ask the daemon while they show it
(`watch_status`, `drain`, `prefetch`): `ckptfs.cli` parses the arguments and calls in here; the
numbers come from the daemon (`ckptfs.api.status`), and nothing here changes them (`status
--json` prints the daemon's reply as it is).

Two audiences, chosen per stream (`fancy`: a terminal, and not TERM=dumb):

  * a terminal gets colours, tables and progress bars redrawn in place (rich `Live`);
  * anything else (a pipe, a file, a log) gets plain text: no escape codes, no carriage returns,
    no box drawing, one line per set whatever its path's length (the plain console is as wide as
    the longest line, so nothing wraps or is cut), and progress as a line every `PLAIN_EVERY`
    seconds.

Output never ends in a traceback: a reader that goes away (`ckptfs status | head -1`) ends the
output quietly (stdout is pointed at /dev/null so the interpreter's last flush cannot fail
either), and a stderr that cannot be written any more turns the progress display off while the
work (an unmount) goes on. Text that came from elsewhere (set paths, which other nodes and the
store name; errors; invalid manifest keys) is shown with its control characters escaped, so a
file name cannot move the cursor or split a line.

State: only the display's own, in the one thread that draws: a `Meter` (or the `Live` of
`watch_status`) holds its rich objects and the last plain line, and is used by the thread that
created it, never shared. Nothing of the daemon's is held: every number comes from a fresh
control-socket reply. Number formatting without rich is in ckptfs/fmt.py.
"""

from __future__ import annotations

import io
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from . import api
from .fmt import duration, human
from .mount import EXIT_OK

# A plain progress line every 5 s: often enough to see a drain move in a CI log, rare enough
# that an hour-long upload leaves ~700 lines (the interval the pre-rich CLI used).
PLAIN_EVERY = 5.0
# How often the CLI asks the daemon while it shows progress: one control-socket round trip
# (~1 ms) five times a second; the daemon's upload rate is a 10 s window anyway.
POLL = 0.2
# The plain console's width: wider than any line status can produce (a set path is at most
# PATH_MAX = 4096 bytes, escaped at most 3x; notes name at most 10 nodes or 5 files), so rich
# never wraps or cuts; lines are right-stripped after rendering.
PLAIN_WIDTH = 1 << 16
# States of a set that is committed but not yet durable in the store
# (cachemgr.core.sets.LIVE_STATES).
AT_RISK = ("committed", "uploading")
# The failed sets named, each on a line of its own, under "at risk" (status --json lists 20).
FAILED_NAMED = 5
# The stuck sets named, each on a line of its own, in the "stuck" row (status --json lists 20).
STUCK_NAMED = 5
# What a stuck set waits for that no wait will end (cachemgr.tiering.progress.STUCK_FOR_GOOD): red.
STUCK_FOR_GOOD = ("content_gone", "upload_lost", "unknown")
STATE_STYLE = {"durable": "green", "committed": "yellow", "uploading": "cyan",
               "failed": "bold red", "deleting": "dim", "deleted": "dim", "replaced": "dim",
               "replicated": "magenta"}
# Below this many columns a terminal gets the sets one above the other: the five number and
# state columns of the table take ~45, which would leave a path no room.
NARROW = 72
HEALTH_STYLE = {"normal": "green", "unstable": "yellow", "down": "bold red"}


# ----------------------------------------------------------------------------------------------
# words


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def safe(s: object) -> str:
    """`s` with control characters (C0, DEL, C1) written as \\xNN: text from elsewhere can
    neither drive the terminal nor break a line in two."""
    return str(s).translate(_CONTROL)


# ----------------------------------------------------------------------------------------------
# streams


def _quiet(stream) -> None:
    """The reader of `stream` (stdout or stderr) went away: send what is still buffered, and
    everything after, to /dev/null, so the interpreter's final flush does not fail too (that
    would print "Exception ignored ..." and exit 120)."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, stream.fileno())
        os.close(fd)
    except (OSError, ValueError):
        pass


def _quiet_stdout() -> None:
    _quiet(sys.stdout)


def write_out(text: str) -> bool:
    """Write `text` to stdout now. False if its reader is gone (then stdout is quiet)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        _quiet_stdout()
        return False


def result(line: str) -> None:
    """A command's one-line result on stdout (`ckptfs: unmounted /mnt/ckpt`)."""
    write_out(line + "\n")


def note(msg: str) -> None:
    """One line `ckptfs: <msg>` on stderr."""
    try:
        print(f"ckptfs: {safe(msg)}", file=sys.stderr, flush=True)
    except OSError:
        _quiet(sys.stderr)  # nobody can read it; an exit code still says what happened


def fail(code: int, msg: str) -> int:
    """The one-line error on stderr; returns `code` for the caller to exit with."""
    note(msg)
    return code


def fancy(stream) -> bool:
    """Draw for a person: `stream` is a terminal that can move its cursor."""
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def _tty_console(file) -> Console:
    return Console(file=file, highlight=False, emoji=False, markup=False)


def plain(renderable: RenderableType) -> str:
    """`renderable` as plain text: no escape codes, nothing wrapped, no trailing blanks."""
    buf = io.StringIO()
    Console(file=buf, width=PLAIN_WIDTH, color_system=None, force_terminal=False,
            force_interactive=False, no_color=True, highlight=False, emoji=False, markup=False,
            legacy_windows=False).print(renderable)
    return "".join(ln.rstrip() + "\n" for ln in buf.getvalue().splitlines())


# ----------------------------------------------------------------------------------------------
# status


def _at_risk(t: dict, now: float) -> Text:
    """Committed but not yet durable, and failed for good and not saved again since: what a
    lost cache disk would take with it. Each failed set on a line of its own, with its reason
    (the first FAILED_NAMED)."""
    n, pending = t.get("pending_sets", 0), t.get("pending_bytes", 0)
    nfailed = t.get("failed_sets", 0)  # absent from a daemon older than this CLI
    nunsaved = t.get("unsaved_files", 0)
    if n == 0 and nfailed == 0 and nunsaved == 0:
        return Text(f"{human(pending)} in 0 sets: every committed set is durable in the store",
                    style="green")
    out = Text()
    if n == 0 and nfailed == 0:
        out.append("every committed set is durable in the store; ", style="green")
    if n:
        live = [s["committed_ns"] for s in t.get("sets", []) if s["state"] in AT_RISK
                and s.get("committed_ns")]
        if t.get("oldest_pending_committed_ns"):  # over every set, not only the recent ones
            live.append(t["oldest_pending_committed_ns"])
        words = f"{human(pending)} in {_plural(n, 'set')} committed but not yet durable"
        if live:
            words += f", the oldest committed {duration(now - min(live) / 1e9)} ago"
        if t.get("waiting_sets"):
            words += f" ({t['waiting_sets']} waiting for other nodes)"
        out.append(words, style="bold yellow")
    if nfailed:
        if n:
            out.append("; ")
        out.append(f"{human(t.get('failed_bytes', 0))} in {_plural(nfailed, 'set')} FAILED, "
                   "not in the store (only in this cache; a new commit of the path retries):",
                   style="bold red")
        shown = t.get("failed", [])[:FAILED_NAMED]
        for f in shown:
            out.append(f"\n  {safe(f['path'])} ({safe(f.get('error') or 'failed')})",
                       style="red")
        if nfailed > len(shown):
            out.append(f"\n  and {nfailed - len(shown)} more", style="red")
    if nunsaved:
        if n or nfailed:
            out.append("; ")
        out.append(unsaved_words(t) + ":", style="bold red")
        named = t.get("unsaved", [])[:FAILED_NAMED]
        for p in named:
            out.append(f"\n  {safe(p)}", style="red")
        if nunsaved > len(named):
            out.append(f"\n  and {nunsaved - len(named)} more", style="red")
    return out


def unsaved_words(t: dict) -> str:
    """What status and umount say of the closed files in no committed set."""
    handed = t.get("handed_files", 0)
    return (f"{human(t.get('unsaved_bytes', 0))} in {_plural(t['unsaved_files'], 'file')} in no "
            "committed set" + (
                ", uploaded for a commit of their directory on another node, in no manifest yet"
                if handed == t["unsaved_files"] else
                f", {handed} of them uploaded for a commit of their directory on another node,"
                " the rest only in this cache" if handed else ", only in this cache") +
            " (nothing uploads them as they are: `ckptfs commit` them, or remove them)")


def _stuck(t: dict) -> Text | None:
    """The sets pending longer than the stuck threshold, whatever their age or position (the
    first STUCK_NAMED, oldest first), each on a line of its own with what it waits for; None
    when there is none (or the daemon is older than this CLI)."""
    n = t.get("stuck_sets", 0)
    if not n:
        return None
    shown = t.get("stuck", [])[:STUCK_NAMED]
    bad = any(x.get("waits_for") in STUCK_FOR_GOOD for x in t.get("stuck", []))
    style = "bold red" if bad else "bold yellow"
    out = Text(f"{_plural(n, 'set')} pending longer than "
               f"{duration(t.get('stuck_after_s', 0))}, oldest first:", style=style)
    for x in shown:
        out.append(f"\n  set {x['seq']} {safe(x['path'])} ({x['state']} "
                   f"{duration(x.get('age_s', 0))}, {x.get('waits_for', '?')}): "
                   f"{safe(x.get('why', ''))}",
                   style="bold red" if x.get("waits_for") in STUCK_FOR_GOOD else "yellow")
    if n > len(shown):
        out.append(f"\n  and {n - len(shown)} more (`ckptfs status --json` lists "
                   f"{len(t.get('stuck', []))})", style=style)
    return out


def _summary(st: dict, now: float) -> Table:
    g = Table.grid(padding=(0, 2))  # label, 2 blanks, value: "data path  passthrough ..."
    g.add_column(style="bold", no_wrap=True)
    g.add_column(overflow="fold")  # a terminal too narrow for a path folds it, never cuts it
    c, io_ = st["cache"], st["io"]
    mount = Text(f"{safe(st['mountpoint'])} (pid {st['pid']}, up {duration(st['uptime_s'])})")
    if st.get("read_only"):
        mount.append("; read-only: nothing is written, here or to the store", style="bold")
    loop = st.get("loop") or {}
    if loop.get("stalls"):
        mount.append(f"; its event loop stalled {loop['stalls']} times, the longest "
                     f"{loop['longest_s']:.1f}s (the daemon's log says where)", style="yellow")
    g.add_row("mount", mount)
    g.add_row("cache dir", Text(
        f"{safe(st['cache_dir'])}: {c['files']} files, {c['dirs']} dirs, {c['symlinks']} "
        f"symlinks, {human(c['bytes'])} ({human(c.get('cached_bytes', c['bytes']))} "
        f"cached); disk free {human(c['disk_free_bytes'])} of {human(c['disk_total_bytes'])}"))
    avg = io_["bytes_written"] / io_["write_requests"] if io_["write_requests"] else 0
    g.add_row("I/O", Text(
        f"{io_['write_requests']} writes ({human(io_['bytes_written'])}, avg {human(avg)}), "
        f"{io_['read_requests']} reads ({human(io_['bytes_read'])}), {io_['fsyncs']} fsyncs; "
        f"{c['open_handles']} open handles"))
    dp = st.get("data_path")
    if dp:
        if dp["mode"] == "passthrough":
            g.add_row("data path", Text(
                f"passthrough: the kernel reads and writes whole cached files "
                f"({dp['passthrough_opens']} opens, {dp['open_backings']} open now); I/O above "
                f"is what the daemon served"))
        else:
            g.add_row("data path", Text(f"the daemon serves file data ({safe(dp['off_reason'])})"))
    t = st.get("tiering")
    if t:
        store, up = t["store"], t["uploads"]
        line = Text(f"{safe(store['url'])}: ")
        line.append(store["health"], style=HEALTH_STYLE.get(store["health"], ""))
        line.append(f" (node {safe(store.get('node', '?'))})")
        cw = store.get("conditional_writes")  # docs/STORES.md: probed at mount
        line.append("; conditional writes " + ("not probed yet (the first commit probes)"
                                               if cw is None else safe(cw["summary"])),
                    style="" if cw is None or cw["honoured"] else "bold red")
        dpath = store.get("data_path")
        if dpath:
            line.append("; data bytes by " + {
                "crt": "the AWS Common Runtime (native)",
                "crt-up": "the AWS Common Runtime (native) up, boto3 down",
                "sendfile": "plain HTTP with the body by sendfile (kernel) up, boto3 down",
                "boto3": "boto3 (Python)",
                "local": "the kernel (file://)"}.get(dpath, safe(dpath)))
        if store.get("last_error"):
            line.append(f"; last error: {safe(store['last_error'])}")
        mem = t.get("members") or {}
        if mem.get("registered") and not mem.get("lease_held"):
            line.append(f"; lease of {mem['lease_s']:.0f}s ran out: other nodes' directory "
                        "commits no longer wait for this node", style="bold red")
        elif not mem.get("registered", True):
            line.append("; not registered in the store yet", style="yellow")
        if mem.get("lease_lapses"):
            line.append(f"; lease ran out {mem['lease_lapses']} times (last at "
                        f"{mem['last_lapse']}), now generation {mem['generation']}",
                        style="yellow")
        g.add_row("store", line)
        g.add_row("at risk", _at_risk(t, now))
        stuck = _stuck(t)
        if stuck is not None:
            g.add_row("stuck", stuck)
        g.add_row("uploads", Text(
            f"{up['running']} running, {up['queued']} queued, "
            f"{human(up['rate_bytes_per_s'])}/s; {up['done']} done, {up['cancelled']} "
            f"cancelled"))
        if t.get("peers"):
            g.add_row("peers", _peers_line(t["peers"]))
    return g


def _peers_line(p: dict) -> Text:
    """--peers: what this node serves, where its restored bytes came from, who is cut off."""
    srv, cl = p.get("server"), p.get("client") or {}
    fp, fs = p["restored_from_peers"], p["restored_from_store"]
    line = Text(f"serving at {safe(srv['endpoint'])} ({human(srv['served_bytes'])} in "
                f"{srv['served_chunks']} chunks served, {srv['refused_auth']} refused); "
                if srv else "")
    line.append(f"restored {human(fp['bytes'])} ({fp['chunks']} chunks) from peers, "
                f"{human(fs['bytes'])} ({fs['chunks']} chunks) from the store")
    r = p.get("replication")
    if r:
        line.append(f"; replicas: {r['replicas']} (buddies "
                    f"{safe(', '.join(r['buddies']) or 'none yet')}), "
                    f"{r['replicated_sets']} set(s) of this node replicated; holding "
                    f"{r['held_for_others']} set(s), {human(r['replica_bytes'])} for others")
    for c in cl.get("cut_off", []):
        line.append(f"; cut off: {safe(c['node'])} at {safe(c['address'])}: {safe(c['why'])}",
                    style="yellow")
    return line


def _table(fancy: bool) -> Table:
    if fancy:
        return Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, header_style="bold")
    # No box, no header rule: columns of text that grep and awk read like the old output.
    return Table(box=None, pad_edge=False, show_edge=False, header_style="")


def _listing(heads: tuple[str, ...], rows: list[tuple[list, Text, list[Text]]], fancy: bool,
             narrow: bool) -> Table:
    """A table of `rows` (cells, path, notes): the path last, each note on a line of its own
    under the path. `heads` names the cells, right-aligned but the second (a state).

    On a terminal narrower than NARROW the cells go on one line and the path on the next,
    folded to the width: a table would leave the path no column at all."""
    if narrow:
        g = Table.grid(padding=(0, 1))
        g.add_column(overflow="fold")
        for cells, path, notes in rows:
            line = Text()
            for head, cell in zip(heads, cells, strict=True):
                line.append(f"{head} " if head != "state" else "")
                line.append(cell if isinstance(cell, Text) else Text(cell))
                line.append("  ")
            g.add_row(line)
            g.add_row(Text("  ").append_text(path))
            for n in notes:
                g.add_row(Text("  ").append_text(n))
        return g
    tab = _table(fancy)
    for i, head in enumerate(heads):
        tab.add_column(head, justify="left" if i == 1 else "right", no_wrap=True)
    # On a terminal a path too long for it folds (there is no other room); in plain text the
    # line is as long as the path, so grep finds the set by its path.
    tab.add_column("path", overflow="fold")
    for cells, path, notes in rows:
        tab.add_row(*cells, path)
        for n in notes:
            tab.add_row(*[""] * len(heads), n)
    return tab


def _sets(t: dict, fancy: bool, narrow: bool) -> Table:
    note = "dim italic" if fancy else ""
    rows = []
    for x in t["sets"]:
        path = Text(safe(x["path"]))
        if x.get("error") and x["state"] != "durable":
            path.append(f"  ({safe(x['error'])})", style="red" if fancy else "")
        notes = []
        w = x.get("waiting_for")
        if w and w.get("acks_from"):
            notes.append(Text(
                f"waiting {w['waited_s']:.0f}s (timeout {w['timeout_s']:.0f}s) for acks from "
                f"nodes {safe(', '.join(w['acks_from'][:10]))}", style=note))
        elif w:
            names = ", ".join(w["files"][:5]) + (" ..." if w["missing"] > 5 else "")
            notes.append(Text(
                f"waiting {w['waited_s']:.0f}s (timeout {w['timeout_s']:.0f}s) for "
                f"{w['missing']} file(s) from other nodes: {safe(names)}", style=note))
        if x.get("after_set") is not None:
            notes.append(Text(f"published after set {x['after_set']} (commit order)",
                              style=note))
        shown = x["state"]
        if x.get("replicated") and shown in ("committed", "uploading"):
            shown = f"replicated/{shown}"  # on K buddies' disks (--replicas), not durable
        if "replicas" in x and x["state"] in ("committed", "uploading"):
            notes.append(Text(f"held by {x['replicas']} buddy node(s)", style=note))
        if x["state"] == "replicated":  # another node's, shown from peers' replicas
            notes.append(Text(f"node {safe(str(x.get('origin', '?')))}'s, read from the "
                              "replicas peers hold: not in the store yet", style=note))
        state = Text(shown, style=STATE_STYLE.get(x["state"], "") if fancy else "")
        rows.append(([str(x["seq"]), state, str(x["files"]), human(x["bytes"]),
                      human(x["bytes_uploaded"])], path, notes))
    return _listing(("set", "state", "files", "size", "uploaded"), rows, fancy, narrow)


def _invalid(t: dict, fancy: bool) -> list[RenderableType]:
    bad = t.get("remote", {}).get("invalid_manifests") or {}
    if not bad:
        return []
    n = t["remote"].get("invalid_count", len(bad))
    # `key: reason`, one a line: the key whole (folded on a narrow terminal), as grep wants it.
    g = Table.grid()
    g.add_column(overflow="fold")
    for key, why in list(bad.items())[:5]:
        g.add_row(Text(f"{safe(key)}: {safe(why)}"))
    return [Text(""), Text(f"invalid manifests: {n} in the store skipped (docs/FORMAT.md "
                           "\"Validation\")" + ("; the first 5 of them:" if n > 5 else ":"),
                           style="bold yellow" if fancy else ""), g]


def _jobs(t: dict, fancy: bool, narrow: bool) -> list[RenderableType]:
    jobs = t.get("restore", {}).get("jobs", [])[-5:]
    if not jobs:
        return []
    rows: list[tuple[list[RenderableType], Text, list[Text]]] = []
    for j in jobs:
        state = "done" if j["finished"] and not j.get("error") else \
            "stopped" if j["finished"] else "running"
        path = Text(safe(j["path"]))
        if j.get("error"):
            path.append(f"  ({safe(j['error'])})", style="red" if fancy else "")
        style = {"done": "green", "stopped": "red"}.get(state, "cyan") if fancy else ""
        rows.append(([str(len(rows) + 1), Text(state, style=style), human(j["bytes_done"]),
                      human(j["bytes_total"]), str(j["files"])], path, []))
    return [Text(""), Text("prefetch jobs (newest last)", style="bold" if fancy else ""),
            _listing(("job", "state", "fetched", "of", "files"), rows, fancy, narrow)]


def status_view(st: dict, fancy: bool, header: str | None = None,
                width: int | None = None) -> RenderableType:
    """The whole `ckptfs status` page for the daemon's reply `st`, for a terminal `width`
    columns wide (None: plain text, as wide as its longest line)."""
    now = time.time()
    narrow = width is not None and width < NARROW
    parts: list[RenderableType] = []
    if header:
        parts += [Text(header, style="bold" if fancy else ""), Text("")]
    parts.append(_summary(st, now))
    t = st.get("tiering")
    if t:
        parts += _invalid(t, fancy)
        if t["sets"]:
            parts += [Text(""), Text("sets (newest last)", style="bold" if fancy else ""),
                      _sets(t, fancy, narrow)]
        parts += _jobs(t, fancy, narrow)
    return Group(*parts)


def print_status(st: dict) -> int:
    if fancy(sys.stdout):
        try:
            console = _tty_console(sys.stdout)
            console.print(status_view(st, fancy=True, width=console.width))
            sys.stdout.flush()
        except BrokenPipeError:
            _quiet_stdout()
        return EXIT_OK
    write_out(plain(status_view(st, fancy=False)))
    return EXIT_OK


def print_json(text: str) -> int:
    write_out(text + "\n")
    return EXIT_OK


def watch_status(mp: Path, interval: float) -> int:
    """Show status every `interval` seconds until Ctrl-C (exit 0). If the daemon stops
    answering (unmounted, died) the last page stays and the error's code is the exit code."""

    def header() -> str:
        return (f"ckptfs status {safe(mp)}, every {interval:g}s (Ctrl-C to stop), "
                f"{datetime.now():%H:%M:%S}")

    try:
        if fancy(sys.stdout):
            console = _tty_console(sys.stdout)
            with Live(console=console, auto_refresh=False, redirect_stdout=False,
                      redirect_stderr=False) as live:
                while True:
                    st = api.status(mp)
                    live.update(status_view(st, fancy=True, header=header(),
                                            width=console.width), refresh=True)
                    time.sleep(interval)
        else:
            while True:
                st = api.status(mp)
                if not write_out(plain(status_view(st, fancy=False, header=header())) + "\n"):
                    return EXIT_OK
                time.sleep(interval)
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_OK
    except api.CkptfsError as e:
        return fail(e.code, str(e))


# ----------------------------------------------------------------------------------------------
# progress


class Meter:
    """One transfer's progress on stderr: a rich bar redrawn in place on a terminal, else a plain
    line now and then every PLAIN_EVERY seconds. Draws nothing until the first `update`.
    A stderr that fails a write turns it off; the caller's work goes on."""

    def __init__(self, label: str, fields: tuple[str, ...], eta: bool) -> None:
        self.label = label
        self.fields = fields
        self.eta = eta
        self.tty = fancy(sys.stderr)
        self.off = False
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.t0 = time.monotonic()
        self.last_line = -PLAIN_EVERY
        self.line = ""      # the latest plain line
        self.printed = ""   # the plain line printed last
        self.closed = False

    def _start(self, done: int, total: int, fields: dict[str, str]) -> None:
        cols = [TextColumn("{task.description}"),
                BarColumn(complete_style="cyan", finished_style="green"), TaskProgressColumn(),
                DownloadColumn(binary_units=True)]
        cols += [TextColumn(f"{{task.fields[{f}]}}") for f in self.fields]
        if self.eta:
            cols += [TransferSpeedColumn(), TimeRemainingColumn()]
        self.progress = Progress(*cols, console=_tty_console(sys.stderr), auto_refresh=False,
                                 transient=False, redirect_stdout=False, redirect_stderr=False)
        # The task before the display starts: its first frame has the numbers, not a pulse.
        extra: dict[str, Any] = fields  # rich: task fields are Any
        self.task = self.progress.add_task(self.label, total=total, completed=done, **extra)
        self.progress.start()

    def update(self, done: int, total: int, plain_line: str, **fields: str) -> None:
        if self.off:
            return
        self.line = plain_line
        try:
            if self.tty:
                if self.progress is None:
                    self._start(done, total, fields)
                else:
                    extra: dict[str, Any] = fields
                    self.progress.update(cast(TaskID, self.task), completed=done, total=total,
                                         **extra)
                    self.progress.refresh()
            elif time.monotonic() - self.last_line >= PLAIN_EVERY:
                self._print(plain_line)
        except OSError:
            self.off = True
            _quiet(sys.stderr)

    def _print(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        self.printed = line
        self.last_line = time.monotonic()

    def close(self) -> None:
        """Stop drawing (the bar stays, as last drawn); a plain display prints its latest line
        unless that was the last one printed."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.progress is not None:
                self.progress.stop()
            elif not self.tty and not self.off and self.line and self.line != self.printed:
                self._print(self.line)
        except OSError:
            _quiet(sys.stderr)
        self.off = True


def drain(mp: Path, timeout: float | None) -> bool:
    """`umount`: show upload progress until no committed set this node can finish is pending.
    False on timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    meter = Meter("uploads", ("sets", "rate", "store"), eta=False)
    total = 0
    try:
        while True:
            st = api.status(mp).get("tiering", {})
            pending, nsets = st.get("pending_bytes", 0), st.get("pending_sets", 0)
            remote = st.get("waiting_sets", 0)
            if nsets - remote <= 0 and pending == 0:
                failed = st.get("failed_sets", 0)
                if total:
                    done = "all sets durable" if not failed else "all other sets durable"
                    meter.update(total, total, f"uploads: {human(total)} of {human(total)} "
                                 f"(100%): {done}", sets=done, rate="", store="")
                meter.close()
                if failed:
                    # Failed for good: no upload will make them durable, and after the unmount
                    # they are only in the cache dir (`ckptfs status` names them and why).
                    paths = [f["path"] for f in st.get("failed", [])[:FAILED_NAMED]]
                    more = f" and {failed - len(paths)} more" if failed > len(paths) else ""
                    note(f"{_plural(failed, 'set')} FAILED and not in the store, only in the "
                         f"cache: {', '.join(paths)}{more} (`ckptfs status` says why)")
                if remote:
                    # Their commits wait for files other nodes write: nothing here can finish
                    # them; they resume at the next mount of this cache dir.
                    note(f"{remote} set(s) still wait for files from other nodes; their"
                         " commit resumes at the next mount")
                return True
            total = max(total, pending)
            rate = human(st.get("uploads", {}).get("rate_bytes_per_s", 0.0)) + "/s"
            health = st.get("store", {}).get("health", "?")
            done = total - pending
            meter.update(done, total,
                         f"uploads: {human(done)} of {human(total)} "
                         f"({done / total if total else 1:.0%}), {_plural(nsets, 'set')} "
                         f"pending, {rate}, store {health}",
                         sets=f"{_plural(nsets, 'set')} pending,", rate=rate + ",",
                         store=f"store {health}")
            if deadline is not None and time.monotonic() >= deadline:
                meter.close()
                return False
            time.sleep(POLL)
    finally:
        meter.close()


def prefetch(mp: Path, job: dict) -> tuple[dict, float]:
    """`prefetch`: show the job's progress until it finishes. Returns its last state and the
    seconds it took."""
    meter = Meter(f"prefetch {safe(job['path'])}", ("files",), eta=True)
    t0 = time.monotonic()
    try:
        while True:
            jobs = {j["path"]: j for j in api.status(mp)["tiering"]["restore"]["jobs"]}
            j = jobs.get(job["path"], job)
            done, total = j["bytes_done"], j["bytes_total"]
            elapsed = max(time.monotonic() - t0, 1e-3)
            rate = done / elapsed
            eta = f", ETA {duration((total - done) / rate)}" if rate and done < total else ""
            meter.update(done, total,
                         f"prefetch {safe(j['path'])}: {human(done)} of {human(total)} "
                         f"({done / total if total else 1:.0%}), {_plural(j['files'], 'file')}, "
                         f"{human(rate)}/s{eta}",
                         files=_plural(j["files"], "file"))
            if j["finished"]:
                return j, time.monotonic() - t0
            time.sleep(POLL)
    finally:
        meter.close()
