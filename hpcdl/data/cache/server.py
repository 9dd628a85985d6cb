"""The node agent's process: ``python -m hpcdl.data.cache.server PARENT_PID SPEC_FILE``, the file an
:class:`~hpcdl.data.cache.agent.AgentSpec` pickled (removed once read); it prints the port it listens on, then answers each
connection in a thread of its own (the requests are :mod:`hpcdl.data.cache.agent`'s)."""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import socket
import socketserver
import struct
import sys

import numpy as np

from hpcdl.data.cache.agent import Agent
from hpcdl.data.cache.spec import AgentSpec
from hpcdl.data.cache.wire import ANNOUNCE, ERROR, GET, GET_SOURCE, OK, PEER_GET, PEERS, REPLY, REQUEST, STATS, recv_exact


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        agent: Agent = self.server.agent
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                head = sock.recv(REQUEST.size, socket.MSG_WAITALL)
            except OSError:
                return
            if len(head) < REQUEST.size:
                return
            op, arg = REQUEST.unpack(head)
            try:
                if op in (GET, GET_SOURCE, PEER_GET):
                    r = agent.get(arg, op)
                    sock.sendall(REPLY.pack(OK, arg, r.label, r.crc, r.version, len(r.data)) + r.data)
                    continue
                if op == ANNOUNCE:
                    epoch, count = struct.unpack("!qq", recv_exact(sock, 16))
                    agent.announce(arg, epoch, np.frombuffer(recv_exact(sock, 8 * count), dtype=">i8").tolist())
                    body = b""
                elif op == PEERS:
                    agent.peers = {int(k): (h, p) for k, (h, p) in json.loads(recv_exact(sock, arg)).items()}
                    agent.peers_known.set()
                    body = b""
                elif op == STATS:  # argument 1: every node's
                    body = json.dumps(stats_of_all(agent) if arg else [agent.stats()]).encode()
                else:
                    raise ValueError(f"unknown request {op}")
                sock.sendall(REPLY.pack(OK, arg, 0, 0, 0, len(body)) + body)
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}".encode()
                try:
                    sock.sendall(REPLY.pack(ERROR, arg, 0, 0, 0, len(message)) + message)
                except OSError:
                    return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024


def _die_with_parent(parent: int) -> None:
    try:  # PR_SET_PDEATHSIG: the agent ends with the rank that started it, however that rank ends
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the rank ended before the signal was asked for
        os._exit(1)


def main() -> None:
    """``python -m hpcdl.data.cache.agent``: the spec pickled on stdin; prints the port it listens on."""
    _die_with_parent(int(sys.argv[1]))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # scancel's: the ranks checkpoint and need their data until then
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(10)  # as the loader's workers: compute wins each core the two contend for
    with open(sys.argv[2], "rb") as f:  # written by the rank for this agent alone
        spec: AgentSpec = pickle.load(f)
    os.unlink(sys.argv[2])
    server = _Server((spec.host, 0), _Handler)
    server.agent = Agent(spec)
    print(server.server_address[1], flush=True)
    server.serve_forever(poll_interval=1.0)


def stats_of_all(agent: Agent) -> list[dict]:
    """This node's counters and every peer's (one request each, a connection of its own: once an epoch, from the
    job's rank 0); a peer that does not answer is left out."""
    found = [agent.stats()]
    for node, address in sorted(agent.peers.items()):
        try:
            with socket.create_connection(address, timeout=10) as sock:
                sock.sendall(REQUEST.pack(STATS, 0))
                status, _, _, _, _, length = REPLY.unpack(recv_exact(sock, REPLY.size))
                body = recv_exact(sock, length)
            if status == OK:
                found.extend(json.loads(body))
        except OSError:
            continue
    return found


if __name__ == "__main__":
    main()
