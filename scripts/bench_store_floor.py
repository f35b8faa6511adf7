#!/usr/bin/env python3
"""What moving a file's bytes to an HTTP server over loopback costs the sender, method by
method (issue 37: where the CRT's CPU per GiB goes, and the floor a data path can reach here).

    python scripts/bench_store_floor.py                      # 1 GiB, 5 rounds
    python scripts/bench_store_floor.py --size 512M --rounds 3 --out docs/bench/store_floor

The server is a sink in a process of its own (`--sink`): it reads each request's headers and
its Content-Length bytes and answers 200 with an ETag, so no S3 server's speed or CPU is in
the figures (a slow server makes a client wake more often for smaller writes: measured against
RGW the CRT cost ~2x what it costs here). The file is in RAM (--dir, /dev/shm by default).

Methods, each in its own process (CPU: user + system of every thread, os.times):

  sendfile      raw TCP, socket.sendfile of the whole file: the kernel's floor (no HTTP)
  copy          raw TCP, read 8 MiB at a time into one buffer and sendall it
  http-sendfile an HTTP/1.1 PUT: headers, then the body by socket.sendfile
  crc32c        no network: the file's CRC32C in 1 MiB reads into one buffer
                (cachemgr.format.decode.crc32c), the uploader's pass for the chunk CRCs before
                a PUT (cachemgr.transfer.upload NATIVE_CRC_READ)
  crc32c-64m    the same in 64 MiB reads (the pass before: the buffer no longer in the cache)
  plainhttp     cachemgr.store.plainhttp's put_file: the daemon's upload client over http://
                (SigV4 UNSIGNED-PAYLOAD, body by sendfile), one PUT, no CRC pass
  crt           awscrt.s3.S3Client PUT_OBJECT of the file as one request (part size above the
                file), send_filepath, CRC32C computed by the CRT into the header, the body not
                hashed for the signature (UNSIGNED-PAYLOAD)
  crt-nocrc     the same without the CRT's CRC32C
  crt-signed    the same with the body's SHA-256 in the signature (what cachemgr.store.crt
                sends over plain http://, as boto3 does)

Down (the sink sends the file by sendfile; the client receives it):

  recv          recv_into one 1 MiB buffer, nothing else: the kernel's receive floor
  recv-crc      the same and the CRC32C of every piece (a chunk checked before it is used)
  recv-crc-write  the same and each piece written into a fresh file in --dir (the cache
                file): the least a verified restore into the cache does
  recv-fresh-write  received into a fresh 64 MiB buffer per range (a GET into memory, then
                checked and written, as the restore's download_chunks + fill do)

Every round runs every method once in a rotated order. On loopback the kernel's receive work
(TCP receive, the copy into the sink's socket buffer) runs in the sender's context and is
charged to the sender; over a NIC it is the other machine's. Reported: median and spread
(min-max) of CPU-s per GiB and wall MB/s per method, the sink's CPU apart.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 1 << 20
GiB = 1 << 30
METHODS = ("sendfile", "copy", "http-sendfile", "crc32c", "crc32c-64m", "plainhttp", "crt",
           "crt-nocrc", "crt-signed", "recv", "recv-crc", "recv-crc-write", "recv-fresh-write")
CLK = os.sysconf("SC_CLK_TCK")


def size_arg(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def pid_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK


# ----------------------------------------------------------------------------------------------
# the sink


def sink(port_file: str, path: str) -> None:
    """Serve until killed: raw connections (first line `RAW n`: n bytes read and dropped;
    `SEND n`: the first n bytes of `path` sent by sendfile) and HTTP/1.1 requests with a
    Content-Length, every byte read and dropped."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    Path(port_file).write_text(str(srv.getsockname()[1]))

    def serve(c: socket.socket) -> None:
        buf = memoryview(bytearray(4 * MiB))
        f = c.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                if line.startswith(b"SEND "):
                    with open(path, "rb") as src:
                        c.sendfile(src, 0, int(line.split()[1]))
                    continue
                raw = line.startswith(b"RAW ")
                n = int(line.split()[1]) if raw else 0
                while not raw:
                    h = f.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    name, _, v = h.decode("latin-1").partition(":")
                    if name.strip().lower() == "content-length":
                        n = int(v)
                while n:
                    got = f.readinto(buf[:min(n, len(buf))])
                    if not got:
                        return
                    n -= got
                c.sendall(b"OK\n" if raw else
                          b'HTTP/1.1 200 OK\r\nETag: "sink"\r\nContent-Length: 0\r\n\r\n')
        finally:
            c.close()
    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


# ----------------------------------------------------------------------------------------------
# the worker: one method, one round


def _crt_put(port: int, path: str, size: int, crc: bool, signed: bool) -> None:
    import awscrt.auth
    import awscrt.http
    import awscrt.io
    import awscrt.s3

    elg = awscrt.io.EventLoopGroup(1)
    creds = awscrt.auth.AwsCredentialsProvider.new_static("testing", "testing")
    signing = awscrt.auth.AwsSigningConfig(
        algorithm=awscrt.auth.AwsSigningAlgorithm.V4,
        signature_type=awscrt.auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
        credentials_provider=creds, region="us-east-1", service="s3",
        use_double_uri_encode=False, should_normalize_uri_path=False,
        signed_body_value=None if signed else awscrt.auth.AwsSignedBodyValue.UNSIGNED_PAYLOAD,
        signed_body_header_type=awscrt.auth.AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256)
    part = max(size + MiB, 8 * MiB)
    client = awscrt.s3.S3Client(
        bootstrap=awscrt.io.ClientBootstrap(elg, awscrt.io.DefaultHostResolver(elg)),
        region="us-east-1", signing_config=signing,
        tls_mode=awscrt.s3.S3RequestTlsMode.DISABLED, part_size=part,
        multipart_upload_threshold=part, memory_limit=max(2 * part, GiB))
    host = f"127.0.0.1:{port}"
    h = awscrt.http.HttpHeaders([("Host", host), ("Content-Length", str(size)),
                                 ("Content-Type", "application/octet-stream")])
    kw: dict[str, Any] = {}
    if crc:
        kw["checksum_config"] = awscrt.s3.S3ChecksumConfig(
            algorithm=awscrt.s3.S3ChecksumAlgorithm.CRC32C,
            location=awscrt.s3.S3ChecksumLocation.HEADER)
    r = client.make_request(type=awscrt.s3.S3RequestType.PUT_OBJECT,
                            request=awscrt.http.HttpRequest("PUT", "/bucket/key", h),
                            send_filepath=path, **kw)
    r.finished_future.result()


async def _plain_put(port: int, path: str, size: int) -> None:
    from cachemgr.store.base import Deadlines
    from cachemgr.store.plainhttp import PlainHttpData, PlainOptions

    client = PlainHttpData(PlainOptions(
        bucket="bucket", prefix="", endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1",
        path_style=True, credentials=lambda: ("testing", "testing", None),
        part_size=size + MiB), Deadlines())
    fd = os.open(path, os.O_RDONLY)
    try:
        await client.put_file("key", fd, size, 0, None)
    finally:
        os.close(fd)
        client.close()


def _recv(method: str, port: int, path: str, size: int) -> None:
    from cachemgr.format.decode import crc32c

    rng = 64 * MiB
    dest = os.open(path + ".down", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(f"SEND {size}\n".encode())
            buf = memoryview(bytearray(MiB))
            off = 0
            while off < size:
                if method == "recv-fresh-write":
                    buf = memoryview(bytearray(min(rng, size - off)))
                want = min(len(buf), size - off)
                got = 0
                while got < want:
                    k = c.recv_into(buf[got:want])
                    if not k:
                        raise SystemExit(f"{method}: the sink closed at {off + got}")
                    got += k
                if method != "recv":
                    crc32c(buf[:want])
                if method in ("recv-crc-write", "recv-fresh-write"):
                    os.pwrite(dest, buf[:want], off)
                off += want
    finally:
        os.close(dest)
        os.unlink(path + ".down")


def worker(method: str, port: int, path: str) -> dict[str, float]:
    size = os.path.getsize(path)
    # what a method imports is imported before the clock starts (a daemon has it loaded)
    if method.startswith("crt"):
        import awscrt.s3  # noqa: F401
    if method == "plainhttp":
        import cachemgr.store.s3  # noqa: F401
    from cachemgr.format.decode import crc32c
    c0, w0 = self_cpu(), time.perf_counter()
    if method in ("sendfile", "copy", "http-sendfile"):
        with socket.create_connection(("127.0.0.1", port)) as c, open(path, "rb") as f:
            if method == "http-sendfile":
                c.sendall(f"PUT /bucket/key HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                          f"Content-Length: {size}\r\n\r\n".encode())
            else:
                c.sendall(f"RAW {size}\n".encode())
            if method == "copy":
                buf = memoryview(bytearray(8 * MiB))
                while k := f.readinto(buf):
                    c.sendall(buf[:k])
            else:
                c.sendfile(f)
            answer = c.recv(4096)
            if not answer.startswith((b"OK", b"HTTP/1.1 200")):
                raise SystemExit(f"{method}: the sink answered {answer[:40]!r}")
    elif method in ("crc32c", "crc32c-64m"):
        buf = memoryview(bytearray(MiB if method == "crc32c" else 64 * MiB))
        value = 0
        with open(path, "rb") as f:
            while k := f.readinto(buf):
                value = crc32c(buf[:k], value)
    elif method == "plainhttp":
        trio.run(_plain_put, port, path, size)
    elif method.startswith("recv"):
        _recv(method, port, path, size)
    else:
        _crt_put(port, path, size, crc=method != "crt-nocrc", signed=method == "crt-signed")
    return {"s": time.perf_counter() - w0, "cpu": self_cpu() - c0}


# ----------------------------------------------------------------------------------------------
# the driver


def mmm(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=size_arg, default=GiB)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--dir", default="/dev/shm", help="where the file goes (RAM by default)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--sink", help=argparse.SUPPRESS)      # sink mode: its port file
    ap.add_argument("--method", help=argparse.SUPPRESS)    # worker mode
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.sink:
        sink(a.sink, a.file)
        return 0
    if a.method:
        print(json.dumps(worker(a.method, a.port, a.file)), flush=True)
        return 0
    methods = a.methods.split(",")
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r} (choose from {', '.join(METHODS)})")
    work = Path(tempfile.mkdtemp(prefix="ckptfs-floor-", dir=a.dir))
    path = work / "src"
    with open(path, "wb") as f:
        for _ in range(a.size // MiB):
            f.write(os.urandom(MiB))
    port_file = work / "port"
    sink_proc = subprocess.Popen([sys.executable, __file__, "--sink", str(port_file),
                                  "--file", str(path)])
    res: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    try:
        for _ in range(200):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        port = int(port_file.read_text())
        for r in range(a.rounds):
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for m in order:
                s0 = pid_cpu(sink_proc.pid)
                out = subprocess.run([sys.executable, __file__, "--method", m, "--port",
                                      str(port), "--file", str(path)], capture_output=True,
                                     text=True, timeout=600)
                if out.returncode != 0:
                    raise SystemExit(f"{m}: {out.stderr.strip()[-400:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["sink_cpu"] = pid_cpu(sink_proc.pid) - s0
                res[m].append(row)
                print(f"round {r} {m:14s} {row['cpu'] * GiB / a.size:5.2f} CPU-s/GiB "
                      f"{a.size / row['s'] / 1e6:7.0f} MB/s", flush=True)
    finally:
        sink_proc.kill()
        sink_proc.wait()
        path.unlink(missing_ok=True)
        port_file.unlink(missing_ok=True)
        work.rmdir()
    gib = a.size / GiB
    table: dict[str, Any] = {}
    for m, rows in res.items():
        table[m] = {"cpu_s_per_gib": mmm([x["cpu"] / gib for x in rows]),
                    "mb_s": mmm([a.size / x["s"] / 1e6 for x in rows]),
                    "sink_cpu_s_per_gib": mmm([x["sink_cpu"] / gib for x in rows])}
    lines = [f"# Store floor: {a.size >> 20} MiB over loopback to a sink, {a.rounds} rounds",
             "", (f"`python scripts/bench_store_floor.py --size {a.size >> 20}M --rounds "
                  f"{a.rounds}` (median [min-max])"), "",
             "| method | client CPU-s/GiB | MB/s | server CPU-s/GiB |", "|---|---|---|---|"]
    for m, t in table.items():
        c, w, s = t["cpu_s_per_gib"], t["mb_s"], t["sink_cpu_s_per_gib"]
        lines.append(f"| {m} | {c['median']:.2f} [{c['min']:.2f}-{c['max']:.2f}] | "
                     f"{w['median']:.0f} [{w['min']:.0f}-{w['max']:.0f}] | "
                     f"{s['median']:.2f} |")
    print("\n".join(lines))
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(
            {"size": a.size, "rounds": a.rounds, "methods": table,
             "load": os.getloadavg()}, indent=1) + "\n")
        Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
