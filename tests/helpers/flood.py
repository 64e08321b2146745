"""A connection flood from the sites' own address: what issue 35 found removing real sites
for good (200 connections held from one address, as a peer behind the sites' NAT would)."""

from __future__ import annotations

import select
import socket
import ssl
import threading
from pathlib import Path
from types import TracebackType


class ConnectionFlood:
    """Keeps ``count`` idle TLS connections open to ``host:port`` (each completes its
    handshake, then says nothing), opening a new one for each the server closes or
    refuses, until the ``with`` block ends.

    ``opened``: connections that completed their handshake; ``refused``: attempts the
    server refused or cut; ``closed``: open ones the server closed later (evicted);
    ``most_held``: the most held open at once.
    """

    def __init__(self, host: str, port: int, ca_cert: Path, count: int = 200) -> None:
        self.host, self.port, self.count = host, port, count
        self.context = ssl.create_default_context(cafile=str(ca_cert))
        self.opened = self.refused = self.closed = self.most_held = 0
        self._held: list[ssl.SSLSocket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="flood", daemon=True)

    def __enter__(self) -> ConnectionFlood:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(30)
        for held in self._held:
            held.close()

    def _hold(self) -> None:
        while not self._stop.is_set():
            self._drop_closed()
            while len(self._held) < self.count and not self._stop.is_set():
                try:
                    raw = socket.create_connection((self.host, self.port), timeout=5)
                    self._held.append(self.context.wrap_socket(raw, server_hostname=self.host))
                except OSError:  # refused (too many from this address), or cut mid-handshake
                    self.refused += 1
                    break  # try again after a look at the open ones
                self.opened += 1
                self.most_held = max(self.most_held, len(self._held))
            self._stop.wait(0.2)

    def _drop_closed(self) -> None:
        """Forget the connections the server closed (readable: at end of stream)."""
        if not self._held:
            return
        readable, _, _ = select.select(self._held, [], [], 0)
        for held in readable:
            try:
                held.setblocking(False)
                ended = held.recv(1) == b""
            except (ssl.SSLWantReadError, BlockingIOError):  # TLS bytes, no data: still open
                ended = False
            except OSError:  # reset by the server
                ended = True
            if ended:
                self._held.remove(held)
                held.close()
                self.closed += 1
