"""The node cache's wire protocol, between a node's readers and its agent and between agents: a request is an op
and an argument (what follows, when the argument gives a length), a reply a status, the sample's index, label,
CRC32 and format version, and the length of the bytes that follow."""

from __future__ import annotations

import socket
import struct

GET, GET_SOURCE, PEER_GET, ANNOUNCE, STATS, PEERS = range(1, 7)
REQUEST = struct.Struct("!Bq")  # op, argument: a sample's index, a local rank, or the length of what follows
REPLY = struct.Struct("!bqqIBi")  # status, the index asked for, label, crc32, the shard's version, length that follows
OK, ERROR = 0, 1


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError(f"the connection closed {got} bytes into a message of {n}")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
