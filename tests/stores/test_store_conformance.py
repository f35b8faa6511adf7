"""Store conformance: every S3 call and header ckptfs relies on, against every store the suite
can start (tests/stores.py: moto, Ceph RGW 16.2 by scripts/rgw.sh, SeaweedFS 4.48 by
scripts/seaweedfs.sh), with boto3 as ckptfs's S3Store uses it.

Where the stores differ, each store's answer is its row in tests/stores.py (`Answers`; AWS S3's
documented answers are the reference row), and a second test shows that ckptfs copes through
`S3Store`: its probe finds what the row says (the ETag form, If-Match on a missing key), and
HEAD stands in for an empty multipart ETag. docs/STORES.md's compatibility table shows the rows
(`test_the_compatibility_table_shows_each_row`); a store that changes its answer fails here
first, and a new store is a new row.
"""

from __future__ import annotations

import base64
import re
import threading

import boto3
import botocore.config
import botocore.exceptions
import crc32c
import pytest
import trio

from cachemgr.store import PreconditionFailed, StoreError, open_store
from cachemgr.store.base import ConditionalWrites, bare_etag, quoted_etag
from tests.conftest import REPO, S3_KIND, new_bucket
from tests.stores import RUN_HERE, STORES, Answers, differences, doc_cells

pytestmark = pytest.mark.s3

RACERS = 8


# The whole suite's pass (on moto) runs the conformance suite on every store it can start; the
# store-facing pass on one store (CKPTFS_TEST_S3, scripts/test.sh) on that store alone.
@pytest.fixture(params=RUN_HERE if S3_KIND == "moto" else (S3_KIND,))
def store_kind(request):
    return request.param


@pytest.fixture
def endpoint(request, store_kind):
    if STORES[store_kind].started_by == "moto":
        return request.getfixturevalue("moto_server")
    return request.getfixturevalue("store_servers")(store_kind)


@pytest.fixture
def answers(store_kind) -> Answers:
    """What this store answers where stores differ: its row."""
    return STORES[store_kind].answers


def client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        config=botocore.config.Config(
                            s3={"addressing_style": "path"},
                            retries={"total_max_attempts": 1, "mode": "standard"},
                            request_checksum_calculation="when_required",
                            response_checksum_validation="when_required"))


@pytest.fixture
def s3(endpoint):
    """(boto3 client, a fresh bucket)."""
    return client(endpoint), new_bucket(endpoint)


def status_of(fn) -> int:
    """The HTTP status of a boto3 call: 200 on success, else the error's."""
    try:
        fn()
        return 200
    except botocore.exceptions.ClientError as e:
        return int(e.response["ResponseMetadata"]["HTTPStatusCode"])


def b64crc(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def race(n: int, fn) -> list[int]:
    """Run fn(i) in n threads released together; their statuses."""
    gate = threading.Barrier(n)
    out: list[int] = [0] * n

    def one(i: int) -> None:
        gate.wait()
        out[i] = status_of(lambda: fn(i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


# ----------------------------------------------------------------------------------------------
# conditional PUT


def one_winner(got: list[int], answers: Answers) -> int:
    """Exactly one writer of a race got 200; the others what that store answers losers."""
    assert got.count(200) == 1, got
    assert {g for g in got if g != 200} <= answers.race_losers, got
    return got.index(200)


def test_put_if_none_match_creates_once_and_one_racer_wins(s3, endpoint, answers):
    c, b = s3
    assert status_of(lambda: c.put_object(Bucket=b, Key="k", Body=b"1", IfNoneMatch="*")) == 200
    assert status_of(lambda: c.put_object(Bucket=b, Key="k", Body=b"2", IfNoneMatch="*")) == 412
    assert c.get_object(Bucket=b, Key="k")["Body"].read() == b"1"
    # eight writers, one client each, racing to create one key: exactly one wins
    clients = [client(endpoint) for _ in range(RACERS)]
    got = race(RACERS, lambda i: clients[i].put_object(Bucket=b, Key="race", Body=b"%d" % i,
                                                       IfNoneMatch="*"))
    winner = one_winner(got, answers)
    assert c.get_object(Bucket=b, Key="race")["Body"].read() == b"%d" % winner
    # a loser retrying (as ckptfs does after a 500) is refused: nothing of it was applied
    for i in range(RACERS):
        if i != winner:
            assert status_of(lambda i=i: clients[i].put_object(
                Bucket=b, Key="race", Body=b"%d" % i, IfNoneMatch="*")) == 412


def test_put_if_match_forms_and_compare_and_swap_race(s3, answers, endpoint):
    c, b = s3
    c.put_object(Bucket=b, Key="k", Body=b"1")
    etag = c.head_object(Bucket=b, Key="k")["ETag"]
    assert etag.startswith('"') and etag.endswith('"')  # HEAD, like S3, quotes it
    assert status_of(lambda: c.put_object(Bucket=b, Key="k", Body=b"x",
                                          IfMatch=quoted_etag("0" * 32))) == 412
    quoted = status_of(lambda: c.put_object(Bucket=b, Key="k", Body=b"2", IfMatch=etag))
    assert (quoted == 200) == answers.if_match_quoted, quoted
    etag = c.head_object(Bucket=b, Key="k")["ETag"]
    assert status_of(lambda: c.put_object(Bucket=b, Key="k", Body=b"3",
                                          IfMatch=bare_etag(etag))) == 200
    # compare-and-swap: eight writers all holding the current ETag; exactly one replaces it
    etag = c.head_object(Bucket=b, Key="k")["ETag"]
    form = etag if answers.if_match_quoted else bare_etag(etag)
    clients = [client(endpoint) for _ in range(RACERS)]
    got = race(RACERS, lambda i: clients[i].put_object(Bucket=b, Key="k", Body=b"cas%d" % i,
                                                       IfMatch=form))
    winner = one_winner(got, answers)
    assert c.get_object(Bucket=b, Key="k")["Body"].read() == b"cas%d" % winner
    for i in range(RACERS):
        if i != winner:
            assert status_of(lambda i=i: clients[i].put_object(
                Bucket=b, Key="k", Body=b"cas%d" % i, IfMatch=form)) == 412


def test_put_if_match_on_a_missing_key(s3, answers):
    c, b = s3
    got = status_of(lambda: c.put_object(Bucket=b, Key="absent", Body=b"1",
                                         IfMatch=quoted_etag("0" * 32)))
    assert got == answers.missing_if_match
    assert status_of(lambda: c.head_object(Bucket=b, Key="absent")) == 404  # not created


# ----------------------------------------------------------------------------------------------
# multipart


def test_multipart_etags_and_conditional_complete(s3, answers):
    c, b = s3
    part = b"p" * (5 << 20)  # S3's minimum for every part but the last
    crcs = []
    up = c.create_multipart_upload(Bucket=b, Key="m", ChecksumAlgorithm="CRC32C")["UploadId"]
    parts = []
    for n, body in ((1, part), (2, b"tail")):
        r = c.upload_part(Bucket=b, Key="m", UploadId=up, PartNumber=n, Body=body,
                          ChecksumCRC32C=b64crc(body))
        assert r["ETag"]
        crcs.append(b64crc(body))
        parts.append({"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32C": b64crc(body)})
    r = c.complete_multipart_upload(Bucket=b, Key="m", UploadId=up,
                                    MultipartUpload={"Parts": parts})
    head = c.head_object(Bucket=b, Key="m")
    assert head["ContentLength"] == len(part) + 4
    assert head["ETag"].strip('"').endswith("-2")  # a multipart ETag names its part count
    assert bool(r.get("ETag")) == answers.complete_etag, r.get("ETag")
    if r.get("ETag"):
        assert r["ETag"] == head["ETag"]
    # If-None-Match on CompleteMultipartUpload of an existing key: RGW 16.2 ignores it and
    # overwrites (AWS, moto and SeaweedFS refuse it), so ckptfs never relies on it (multipart
    # objects have keys no one else writes)
    up = c.create_multipart_upload(Bucket=b, Key="m")["UploadId"]
    r2 = c.upload_part(Bucket=b, Key="m", UploadId=up, PartNumber=1, Body=b"new")
    got = status_of(lambda: c.complete_multipart_upload(
        Bucket=b, Key="m", UploadId=up, IfNoneMatch="*",
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": r2["ETag"]}]}))
    assert (got == 412) == answers.complete_if_none_match, got
    size = c.head_object(Bucket=b, Key="m")["ContentLength"]
    assert size == (len(part) + 4 if got == 412 else 3)
    if got == 412:
        c.abort_multipart_upload(Bucket=b, Key="m", UploadId=up)
    # abort: the upload is gone, and nothing was written
    up = c.create_multipart_upload(Bucket=b, Key="aborted")["UploadId"]
    c.upload_part(Bucket=b, Key="aborted", UploadId=up, PartNumber=1, Body=b"x")
    c.abort_multipart_upload(Bucket=b, Key="aborted", UploadId=up)
    assert status_of(lambda: c.head_object(Bucket=b, Key="aborted")) == 404
    listed = c.list_multipart_uploads(Bucket=b).get("Uploads", [])
    assert up not in [u["UploadId"] for u in listed]


# ----------------------------------------------------------------------------------------------
# reads, listings, deletes, checksums


def test_ranged_get_with_if_match(s3):
    c, b = s3
    body = bytes(range(256)) * 64
    c.put_object(Bucket=b, Key="r", Body=body)
    etag = c.head_object(Bucket=b, Key="r")["ETag"]
    for tag in (etag, bare_etag(etag)):  # both forms, on both stores
        r = c.get_object(Bucket=b, Key="r", Range="bytes=100-199", IfMatch=tag)
        assert r["Body"].read() == body[100:200]
        assert r["ContentLength"] == 100
    r = c.get_object(Bucket=b, Key="r", Range=f"bytes={len(body) - 10}-{len(body) + 100}")
    assert r["Body"].read() == body[-10:]  # a range past the end is cut to the object
    assert status_of(lambda: c.get_object(Bucket=b, Key="r", Range="bytes=0-9",
                                          IfMatch=quoted_etag("0" * 32))) == 412
    assert status_of(lambda: c.get_object(Bucket=b, Key="r",
                                          Range=f"bytes={len(body)}-")) == 416


def test_list_pages_in_key_order(s3):
    c, b = s3
    keys = sorted([f"manifests/d{i:02d}/x.json" for i in range(7)] + ["manifests/a b.json",
                                                                      "manifests/%25/h.json"])
    for k in keys:
        c.put_object(Bucket=b, Key=k, Body=k.encode())
    c.put_object(Bucket=b, Key="other/k", Body=b"")
    pages = list(c.get_paginator("list_objects_v2").paginate(
        Bucket=b, Prefix="manifests/", PaginationConfig={"PageSize": 2}))
    assert len(pages) == 5
    listed = [o["Key"] for p in pages for o in p.get("Contents", [])]
    assert listed == keys
    sizes = {o["Key"]: o["Size"] for p in pages for o in p.get("Contents", [])}
    assert sizes == {k: len(k.encode()) for k in keys}


def test_deletes_are_idempotent(s3):
    c, b = s3
    c.put_object(Bucket=b, Key="d", Body=b"1")
    assert status_of(lambda: c.delete_object(Bucket=b, Key="d")) == 200
    assert status_of(lambda: c.head_object(Bucket=b, Key="d")) == 404
    assert status_of(lambda: c.get_object(Bucket=b, Key="d")) == 404
    assert status_of(lambda: c.delete_object(Bucket=b, Key="d")) == 200  # absent: no error


def test_checksums_and_user_metadata(s3, answers):
    c, b = s3
    c.put_object(Bucket=b, Key="c", Body=b"hello", ChecksumCRC32C=b64crc(b"hello"),
                 Metadata={"ckptfs-crc32c": str(crc32c.crc32c(b"hello"))})
    head = c.head_object(Bucket=b, Key="c")
    assert head["Metadata"] == {"ckptfs-crc32c": str(crc32c.crc32c(b"hello"))}
    # A wrong x-amz-checksum-crc32c: AWS and SeaweedFS refuse it (400 BadDigest); moto and RGW
    # 16.2 store the object anyway, which is why ckptfs checks every chunk it reads against its
    # manifest.
    got = status_of(lambda: c.put_object(Bucket=b, Key="bad", Body=b"hello",
                                         ChecksumCRC32C="AAAAAA=="))
    assert got == (400 if answers.checksum_verified else 200), got
    assert status_of(lambda: c.head_object(Bucket=b, Key="bad")) == (
        404 if answers.checksum_verified else 200)
    # the same for a part of a multipart upload (ckptfs sends each part's CRC32C)
    up = c.create_multipart_upload(Bucket=b, Key="bad-part", ChecksumAlgorithm="CRC32C")
    got = status_of(lambda: c.upload_part(Bucket=b, Key="bad-part", UploadId=up["UploadId"],
                                          PartNumber=1, Body=b"hello",
                                          ChecksumCRC32C="AAAAAA=="))
    assert got == (400 if answers.checksum_verified else 200), got
    c.abort_multipart_upload(Bucket=b, Key="bad-part", UploadId=up["UploadId"])


# ----------------------------------------------------------------------------------------------
# the table: docs/STORES.md shows each row


def compatibility_table() -> dict[str, dict[str, str]]:
    """docs/STORES.md's compatibility table: {store title: {column header: cell}}."""
    text = (REPO / "docs" / "STORES.md").read_text()
    section = text.split("\n## Compatibility", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert len(cells) == len(header), ln
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def test_the_compatibility_table_shows_each_row():
    """Every store of tests/stores.py has its row in docs/STORES.md, with the version it was
    measured on and its answers; a cell is bold exactly where the store differs from AWS S3,
    the reference row."""
    table = compatibility_table()
    assert set(table) == {s.title for s in STORES.values()}, sorted(table)
    for store in STORES.values():
        row = table[store.title]
        assert row["version"] == store.version, row
        bold = differences(store, STORES["aws"])
        for column, want in doc_cells(store).items():
            got = row[column]
            assert re.sub(r"\*\*(.*?)\*\*", r"\1", got) == want, (store.name, column, got)
            assert got.startswith("**") == (column in bold), (store.name, column, got)
        assert row["tested"].startswith("no") == (not store.started_by), row


# ----------------------------------------------------------------------------------------------
# ckptfs copes: S3Store over the same stores


def test_s3store_probe_finds_each_store_and_writes_conditionally(endpoint, answers):
    bucket = new_bucket(endpoint)

    async def main() -> None:
        st = open_store(f"s3://{bucket}/pfx", endpoint_url=endpoint, path_style=True)
        assert st.conditional is None and st.supports_conditional_put  # not probed yet
        found = await st.probe_conditional()
        assert found == answers.probe()
        assert await st.list("") == []  # the probe's scratch objects are gone
        # three saves of one manifest key, each replacing the one before (the RGW bug)
        info = await st.put("manifests/m.pt.json", b"1", if_none_match=True)
        for n in (b"2", b"3"):
            info = await st.put("manifests/m.pt.json", n, if_match=info.etag)
        assert await st.get("manifests/m.pt.json") == b"3"
        with pytest.raises(PreconditionFailed):
            await st.put("manifests/m.pt.json", b"4", if_none_match=True)
        with pytest.raises(PreconditionFailed):
            await st.put("manifests/m.pt.json", b"4", if_match=quoted_etag("0" * 32))
        # a multipart object's ETag: the store's answer or, if empty (RGW), HEAD's
        up = await st.create_multipart("data/n/1/1/x")
        part = await st.upload_part("data/n/1/1/x", up, 1, b"abc")
        done = await st.complete_multipart("data/n/1/1/x", up, [part], crc32c.crc32c(b"abc"))
        head = await st.head("data/n/1/1/x")
        assert done.etag and done.etag == head.etag and head.size == 3
        await st.aclose()

    trio.run(main)


def test_a_store_that_ignores_conditions_is_found_out(moto_server):
    """The fault proxy strips If-None-Match and If-Match on their way to the store: the probe
    says so, a conditional PUT refuses to pretend, and with the override it writes plainly.
    (moto only: RGW checks the request signature, which covers those headers.)"""
    from tests.faultproxy import FaultProxy, Rule

    bucket = new_bucket(moto_server)
    with FaultProxy(moto_server) as proxy:
        proxy.set_rules([Rule("strip_conditions", ops={"put"})])

        async def main() -> None:
            st = open_store(f"s3://{bucket}/p", endpoint_url=proxy.url, path_style=True)
            found = await st.probe_conditional()
            assert not found.honoured and not found.if_none_match and not found.if_match
            assert not st.supports_conditional_put
            with pytest.raises(StoreError, match="ignores If-None-Match and If-Match"):
                await st.put("manifests/a.json", b"1", if_none_match=True)
            lax = open_store(f"s3://{bucket}/p", endpoint_url=proxy.url, path_style=True,
                             allow_unconditional=True)
            await lax.probe_conditional()
            await lax.put("manifests/a.json", b"1", if_none_match=True)
            await lax.put("manifests/a.json", b"2", if_none_match=True)  # last writer wins
            assert await lax.get("manifests/a.json") == b"2"

        trio.run(main)


def test_scratch_key_is_unique_per_probe(endpoint):
    """Two nodes probing one prefix at once do not disturb each other."""
    bucket = new_bucket(endpoint)

    async def main() -> None:
        stores = [open_store(f"s3://{bucket}/same", endpoint_url=endpoint, path_style=True)
                  for _ in range(4)]
        found: list[ConditionalWrites] = []

        async def one(st) -> None:
            found.append(await st.probe_conditional())

        async with trio.open_nursery() as n:
            for st in stores:
                n.start_soon(one, st)
        assert len(found) == 4 and all(f.honoured for f in found), found
        assert await stores[0].list("") == []

    trio.run(main)
