"""The canonical encodings the chain hashes and the checkpoints sign.

Every field is length-prefixed (a 4-byte big-endian length, then its bytes), integers are 8-byte
big-endian, times are the IEEE double SQLite stores, and each encoding starts with its own domain
tag: no two different records encode to the same bytes, and an event's bytes can never pass for a
checkpoint's. Changing any of this changes every hash: a new tag (``-v2``) then, never an edit.
"""

from __future__ import annotations

import hashlib
import struct

HASH_BYTES = 32
ZERO_HASH = bytes(HASH_BYTES)            # the previous hash of the chain's first event (and a session's)
EVENT_TAG = b"sandboxd-audit-event-v1"
CHECKPOINT_TAG = b"sandboxd-audit-checkpoint-v1"


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _text(text: str) -> bytes:
    return _field(text.encode("utf-8", "surrogatepass"))


def _integer(value: int) -> bytes:
    return _field(struct.pack(">q", value))


def event_hash(event_id: int, time: float, session_id: str, sequence: int, kind: str, call_id: str, tool: str,
               data_text: str, prev_hash: bytes, session_prev_hash: bytes) -> bytes:
    """SHA-256 of one event as stored (``data_text``: its JSON exactly as the row holds it), linked
    to the node stream's previous event and the session's previous event."""
    encoded = b"".join((
        _field(EVENT_TAG), _integer(event_id), _field(struct.pack(">d", time)), _text(session_id),
        _integer(sequence), _text(kind), _text(call_id), _text(tool), _text(data_text),
        _field(prev_hash), _field(session_prev_hash)))
    return hashlib.sha256(encoded).digest()


def checkpoint_message(checkpoint_id: int, kind: str, genesis_id: int, last_event_id: int, head_hash: bytes,
                       count: int, pruned_through: int, pruned_hash: bytes, pruned_count: int,
                       prev_digest: bytes, time: float, key_id: str, interval: int = 0) -> bytes:
    """The bytes a checkpoint's signature covers: where the chain starts (``genesis_id``), its head
    (the last event's id and hash, and how many events the chain holds up to it, pruned ones
    included), what retention removed (every event up to ``pruned_through``, the last of them
    hashing to ``pruned_hash``), the previous checkpoint (the SHA-256 of its message), and the
    checkpoint interval it was written under (``interval``; 0, an older checkpoint's: not signed,
    so the message is the one that older sandboxd signed)."""
    return b"".join((
        _field(CHECKPOINT_TAG), _integer(checkpoint_id), _text(kind), _integer(genesis_id),
        _integer(last_event_id), _field(head_hash), _integer(count), _integer(pruned_through),
        _field(pruned_hash), _integer(pruned_count), _field(prev_digest), _field(struct.pack(">d", time)),
        _text(key_id))) + (_integer(interval) if interval else b"")


def digest(message: bytes) -> bytes:
    return hashlib.sha256(message).digest()
