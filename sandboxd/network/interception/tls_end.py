"""One TLS side of an intercepted connection, on the loop: an ``SSLObject`` over two memory
buffers, so no call ever blocks or needs a thread. The owner moves ciphertext between the socket
and ``feed``/``pending_out`` and plaintext through ``read``/``write``."""

from __future__ import annotations

import ssl

CHUNK = 32 * 1024


class TlsEnd:
    """A TLS endpoint (``server_side`` toward the sandbox, client toward the upstream)."""

    def __init__(self, context: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None) -> None:
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                     server_hostname=server_hostname)
        self.handshaken = False
        self.eof = False                                # the peer ended its side (close_notify or TCP EOF)

    def feed(self, data: bytes) -> None:
        """Ciphertext read from the socket (b"": the socket's EOF)."""
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    def handshake(self) -> bool:
        """Go on with the handshake: True once done. ssl.SSLError when it failed (a certificate that
        does not verify: ssl.SSLCertVerificationError)."""
        if not self.handshaken:
            try:
                self._ssl.do_handshake()
            except ssl.SSLWantReadError:
                return False
            self.handshaken = True
        return True

    def read(self) -> bytes:
        """The plaintext available now (b"" when none); sets ``eof`` when the peer ended."""
        pieces: list[bytes] = []
        while not self.eof:
            try:
                piece = self._ssl.read(CHUNK)
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                self.eof = True
                break
            if not piece:
                self.eof = True
                break
            pieces.append(piece)
        return b"".join(pieces)

    def write(self, data: bytes) -> None:
        """Plaintext to send (after the handshake): its records wait in ``pending_out``."""
        if data:
            self._ssl.write(data)

    def close_notify(self) -> None:
        """Send our close_notify (best effort)."""
        try:
            self._ssl.unwrap()
        except ssl.SSLError:
            pass

    def pending_out(self) -> bytes:
        """Ciphertext to write to the socket."""
        return self._outgoing.read()

    @property
    def alpn(self) -> str | None:
        return self._ssl.selected_alpn_protocol()


__all__ = ["TlsEnd"]
