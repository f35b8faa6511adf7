"""The replica routes on the peer port (--replicas, cachemgr.tiering.replicate and peernamespace):
their targets, bounds and headers. No I/O. The transport under them (authentication, the
server, the client) is cachemgr.peer, which hands a request under REPLICA_PREFIX to the route
the engine gave it and knows nothing of what follows.

    POST /v1/replica/offer      (body: a replica offer, JSON, at most MAX_OFFER_BYTES)
        a node offers a set it committed to a buddy (cachemgr.tiering.replicate): 200 the
        buddy holds it (fsynced), 202 it is pulling it (offer again later), 507 it has no room,
        400 a malformed or invalid offer, 503 its queue of offers is full.
    GET /v1/replica/file?seq=<set seq>&i=<file index>&off=<offset>&len=<length>
        the buddy pulls the offered bytes from the set's origin: 200 with exactly those bytes
        of the committed content and `X-Ckptfs-Crc32c` (their CRC32C, decimal), 410 when the
        file changed since its commit (the origin offers the newer commit), 404 no such set or
        file here, 400 malformed.
    POST /v1/replica/dropped
        a buddy tells an origin it dropped a replica (it needed the room).
    GET /v1/replica/namespace?n=<32 hex digits, random>
        the replicas this node holds, as the manifests a restoring node shows while the store
        cannot be listed (cachemgr.tiering.peernamespace): 200 with a JSON document (at most
        MAX_NAMESPACE_BYTES), signed by the server (cachemgr.peer.proto.sign_response):
        unlike a chunk, these bytes have no store document to be checked against. Their
        files' objects are `data/<origin>/replica/<seq>/<i>`, served by GET /v1/chunk from the
        replica (each chunk checked against the CRC32C the buddy checked when it pulled it).

A node's buddies (`buddies`): highest-random-weight of (node id, peer id), so they move only
when one of them comes or goes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from cachemgr.format.validate import REPLICA_CHUNK
from cachemgr.peer.proto import MAX_BODY, PeerEndpoint, route_query

REPLICA_PREFIX = "/v1/replica/"
OFFER_ROUTE = "/v1/replica/offer"
FILE_ROUTE = "/v1/replica/file"
DROPPED_ROUTE = "/v1/replica/dropped"   # a buddy tells an origin it dropped a replica (room)
NAMESPACE_ROUTE = "/v1/replica/namespace"  # the replicas a node holds, as manifests
H_CRC = b"x-ckptfs-crc32c"    # the CRC32C of a replica range's bytes
MAX_OFFER_BYTES = MAX_BODY    # a replica offer's body (the transport's bound on any body)
MAX_RANGE = REPLICA_CHUNK     # bytes per replica file range (4 MiB: a replica's chunks)
MAX_NAMESPACE_BYTES = 64 << 20  # a namespace answer's body (validate.MAX_DOCUMENT_BYTES)


def file_target(seq: int, index: int, off: int, length: int) -> str:
    return f"{FILE_ROUTE}?seq={seq}&i={index}&off={off}&len={length}"


@dataclass(frozen=True, slots=True)
class FileRequest:
    seq: int
    index: int
    off: int
    length: int


def parse_file_target(target: str) -> FileRequest | None:
    """The replica range a request target names, or None when it is not well-formed."""
    q = route_query(target, FILE_ROUTE)
    if q is None:
        return None
    try:
        vals = [q[k] for k in ("seq", "i", "off", "len")]
    except KeyError:
        return None
    if any(len(v) != 1 or not (v[0].isascii() and v[0].isdigit()) or len(v[0]) > 19
           for v in vals):
        return None
    seq, i, off, length = (int(v[0]) for v in vals)
    if not 0 < length <= MAX_RANGE:
        return None
    return FileRequest(seq, i, off, length)


def namespace_target() -> str:
    """A namespace request's target: a fresh random `n`, which its answer's signature covers
    (so an answer recorded earlier does not pass for the answer to this request)."""
    return f"{NAMESPACE_ROUTE}?n={os.urandom(16).hex()}"


def buddies(node: str, peers: list[PeerEndpoint]) -> list[PeerEndpoint]:
    """Every peer but `node`, in the order `node` offers its sets to them (the first K are its
    buddies; the next ones are asked when one refuses): highest-random-weight of (node id,
    peer id), so a node's buddies move only when one of them comes or goes."""
    def weight(p: PeerEndpoint) -> bytes:
        return hashlib.sha256(f"replica\0{node}\0{p.node}".encode("utf-8",
                                                                  "surrogatepass")).digest()

    return sorted((p for p in peers if p.node != node), key=weight, reverse=True)
