"""A real PeerServer on 127.0.0.1 serving the chunks of one object (tests/unit/test_peers_unit.py,
and the hung-peer test of tests/unit/test_hang.py).
"""

from __future__ import annotations

from cachemgr.format.decode import crc32c
from cachemgr.format.objects import StoredObject
from cachemgr.peer import server as peerserve
from cachemgr.peer.proto import PeerConfig

SECRET = b"s3cret"
CS = 1 << 16


def _obj(data: bytes) -> StoredObject:
    crcs = tuple(crc32c(data[i:i + CS]) for i in range(0, len(data), CS))
    return StoredObject(key="data/srv/4/1/f", size=len(data), stored_size=len(data),
                        crc32c=crc32c(data), chunk_size=CS, chunk_crcs=crcs)


def _server(data: bytes, tamper: bool = False, **cfg) -> peerserve.PeerServer:
    pc = PeerConfig(secret=SECRET, listen_host="127.0.0.1", advertise="127.0.0.1", **cfg)
    obj = _obj(data)

    async def serve(key: str, crc: int, i: int) -> bytes | None:
        if key != obj.key or crc != obj.crc32c or not 0 <= i < len(obj.chunk_crcs or ()):
            return None
        raw = data[i * CS:(i + 1) * CS]
        return raw[::-1] if tamper else raw

    return peerserve.PeerServer(cfg=pc, sock=peerserve.bind(pc), serve_chunk=serve)
