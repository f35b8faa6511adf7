"""The one writer of set manifests: `ManifestWriter.write` makes every PUT of a `manifests/` key,
for the namespace worker publishing this node's commits (cachemgr.tiering.publish) and for a
buddy publishing the replica of a node whose lease ran out (cachemgr.tiering.takeover).

The rule (docs/SEMANTICS.md "Conflicts"): the store keeps, at each path, the later of its
commits (`mf.Commit.later_than`: one node's commits by seq, two nodes' by commit time, a tie
going to the larger node id). A manifest replaces the one at its path only when its commit is
later; the same commit there already (a PUT whose reply was lost, the origin and its buddy, two
buddies) counts as written and is left as it is; a later commit there wins and nothing is
written. Who writes makes no difference: a takeover's manifest carries its origin's commit, and
that is what is compared, so the store ends with the same manifest whether the origin or a
buddy published it, and whatever order the PUTs arrive in. Every writer obeys the rule, so a
manifest at a path is only ever replaced by a later commit's: a takeover never overwrites a
newer set, nor brings back one that a later commit replaced. (A manifest deleted from the store
leaves no trace: a commit published after the deletion creates the path again, whoever writes
it; docs/SEMANTICS.md "Replicated" says when.)

How it is kept with other writers racing: every PUT is conditional on what this writer last saw
at the key (If-Match its etag, If-None-Match when it saw none), so a manifest that lands between
a look and the PUT is never overwritten unseen: the PUT is refused and the writer looks again, at
most ATTEMPTS times. A caller may say what it believes is there (`Seen`: the namespace worker
knows the manifest its index holds at the path); a belief in nothing or in an earlier commit is
acted on without a look (the common publication: one PUT), any other belief is looked at first.
A store found to ignore conditional PUTs (mounted with --store-ignores-conditions; docs/STORES.md)
is looked at before every PUT and the rule applied, but the PUT is plain: a commit landing
between the look and the PUT is overwritten. `fence` is awaited before every PUT (the lease:
nothing is written on a lease this node no longer holds).

State: none of its own between writes; the store is the only record.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import trio

from cachemgr.format import manifest as mf
from cachemgr.format.docs import ManifestDoc
from cachemgr.store import NotFound, ObjectStore, PreconditionFailed, StoreError

log = logging.getLogger(__name__)

ATTEMPTS = 8  # looks and PUTs of one write before "kept changing"


@dataclass(frozen=True, slots=True)
class Seen:
    """What a caller believes is at a manifest's key: the manifest with `etag`, of `commit`, or
    nothing (`NOTHING`)."""

    etag: str | None
    commit: mf.Commit | None


NOTHING = Seen(None, None)


@dataclass(frozen=True, slots=True)
class Written:
    """How a write ended. "written": this manifest is at the path now (`etag` its own);
    "same": the store held this very commit already (`there`, `etag` its); "later": it held a
    later commit of the path (`there`, `etag` its), which stays."""

    outcome: Literal["written", "same", "later"]
    etag: str
    there: ManifestDoc | None = None


@dataclass(frozen=True, slots=True)
class _There:
    etag: str | None           # None: no manifest at the key
    doc: ManifestDoc | None  # None: none, or one no reader accepts (replaced by any commit)


class ManifestWriter:
    """The conditional PUT of set manifests with the one rule (module docstring)."""

    def __init__(self, store: ObjectStore, fence: Callable[[], Awaitable[None]]) -> None:
        self.store = store
        self._fence = fence

    async def write(self, m: ManifestDoc, data: bytes, seen: Seen | None = None) -> Written:
        """PUT manifest `m` (built by mf.build, serialised as `data`) at its path's key unless
        the store holds the same or a later commit there. `seen`: what the caller believes is
        there (None: it does not know). StoreError when the store refuses, keeps changing, or
        takes conditional PUTs otherwise than its probe found."""
        key = mf.manifest_key(m["path"])
        mine = mf.commit_of(m)
        conditional = self.store.supports_conditional_put
        expect: str | None = None
        look = not conditional or seen is None or (seen.etag is not None and (
            seen.commit is None or not mine.later_than(seen.commit)))
        if not look:
            assert seen is not None
            expect = seen.etag
        refused: str | None = None  # the ETag an If-Match was last refused with
        there: _There | None = None
        for _attempt in range(ATTEMPTS):
            if look:
                there = await self._look(key)
                if there.doc is not None:
                    theirs = mf.commit_of(there.doc)
                    if not mine.later_than(theirs):
                        assert there.etag is not None
                        return Written("later" if theirs.later_than(mine) else "same",
                                       there.etag, there.doc)
                if refused is not None and there.etag == refused:
                    # Nothing changed, yet If-Match with its ETag was refused: a store that
                    # does not take the ETag in the form the probe found (docs/STORES.md).
                    # Retrying cannot help; say so instead of "kept changing".
                    raise StoreError(f"the store refused If-Match with the current ETag of"
                                     f" {key} ({refused}): its conditional writes are not what"
                                     f" the probe found ({self.store.conditional})")
                expect = there.etag
            await self._fence()
            try:
                if not conditional:
                    info = await self.store.put(key, data)
                elif expect is None:
                    info = await self.store.put(key, data, if_none_match=True)
                else:
                    info = await self.store.put(key, data, if_match=expect)
            except PreconditionFailed:
                # Another writer meanwhile (or a manifest the caller did not know of): look.
                refused, look = expect, True
                continue
            except NotFound:
                # If-Match on a key with no object: S3 answers 404 NoSuchKey, not 412 (the
                # manifest expected there was deleted meanwhile). Nothing to replace: create it,
                # still conditionally (If-None-Match: one landing meanwhile is looked at).
                refused, look, expect, there = None, False, None, None
                continue
            if there is not None and there.doc is not None and \
                    there.doc["commit"]["node"] != m["commit"]["node"]:
                log.info("manifest of %s: node %s's commit (set %d) replaced an earlier"
                         " concurrent commit from node %s", m["path"], m["commit"]["node"],
                         m["commit"]["seq"], there.doc["commit"]["node"])
            return Written("written", info.etag)
        raise StoreError(f"the manifest of {m['path']} kept changing under conditional PUTs")

    async def _look(self, key: str) -> _There:
        """The manifest at `key` now: its ETag and document (a document no reader accepts:
        None, replaced by any commit)."""
        try:
            info = await self.store.head(key)
            data = await self.store.get(key)
        except NotFound:
            return _There(None, None)
        try:
            # a worker thread: the JSON of a big manifest never holds the loop (issue 36)
            doc: ManifestDoc = await trio.to_thread.run_sync(mf.loads, data, key)
        except mf.ManifestError:
            return _There(info.etag, None)
        return _There(info.etag, doc)
