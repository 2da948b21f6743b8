"""The daemon's checkpoint signing key: Ed25519, made on first start in the state directory.

``audit-signing.key`` (the private key, PKCS#8 PEM) must be a regular file, not a symlink, of the
daemon's uid, readable by nobody else: anything else is refused with what to fix, never used
(someone who could replace it could sign checkpoints of a rewritten log). ``audit-signing.pub``
beside it holds the public key in the one-line form ``sandboxd audit pubkey`` prints, which a
verifier elsewhere pins (``sandboxd audit verify --pubkey FILE``).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import stat

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from sandboxd.errors import InvalidPolicy

KEY_FILE = "audit-signing.key"
PUBLIC_FILE = "audit-signing.pub"
MAX_KEY_FILE = 4096
PUBLIC_PREFIX = "ed25519"


def key_id(public: Ed25519PublicKey) -> str:
    """A short name for a public key: the first 16 hex digits of SHA-256 of its 32 raw bytes."""
    return hashlib.sha256(_raw(public)).hexdigest()[:16]


def public_line(public: Ed25519PublicKey) -> str:
    """``ed25519 BASE64 key-id ID``: what ``sandboxd audit pubkey`` prints and ``--pubkey`` reads."""
    return f"{PUBLIC_PREFIX} {base64.b64encode(_raw(public)).decode()} key-id {key_id(public)}"


def parse_public(text: str) -> Ed25519PublicKey:
    """A public key as ``public_line`` writes it, or as PEM. InvalidPolicy otherwise."""
    body = text.strip()
    if body.startswith("-----BEGIN"):
        try:
            loaded = serialization.load_pem_public_key(body.encode())
        except ValueError as exc:
            raise InvalidPolicy(f"not a PEM public key: {exc}") from None
        if not isinstance(loaded, Ed25519PublicKey):
            raise InvalidPolicy("the PEM public key is not an Ed25519 key")
        return loaded
    words = body.split()
    if len(words) < 2 or words[0] != PUBLIC_PREFIX:
        raise InvalidPolicy("a public key must read 'ed25519 BASE64 ...' (what `sandboxd audit pubkey` prints) or PEM")
    try:
        raw = base64.b64decode(words[1], validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise InvalidPolicy("the ed25519 public key is not 32 bytes of base64") from None


class Signer:
    """The private key, with its public half and id."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = private.public_key()
        self.key_id = key_id(self.public)

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)


def verifies(public: Ed25519PublicKey, signature: bytes, message: bytes) -> bool:
    try:
        public.verify(signature, message)
    except InvalidSignature:
        return False
    return True


def load_or_create(state_dir: str) -> Signer:
    """The key in ``state_dir``, made (and its public file written) when there is none."""
    path = os.path.join(state_dir, KEY_FILE)
    try:
        private = _read_private(path)
    except FileNotFoundError:
        private = _create(path)
    signer = Signer(private)
    _write_public(os.path.join(state_dir, PUBLIC_FILE), signer.public)
    return signer


def read_public_of_state(state_dir: str) -> Ed25519PublicKey:
    """The public key a state directory's daemon signs with: from the private key when this user
    may read it (and it is one the daemon would use), else from ``audit-signing.pub``.
    FileNotFoundError when neither is there. Unpinned: whoever could write the directory chose it."""
    try:
        return _read_private(os.path.join(state_dir, KEY_FILE)).public_key()
    except (PermissionError, FileNotFoundError, InvalidPolicy):
        pass                                      # not ours to read, or not one the daemon would use
    return read_public_file(os.path.join(state_dir, PUBLIC_FILE))


def read_public_file(path: str) -> Ed25519PublicKey:
    """A public key file (``--pubkey``, ``audit-signing.pub``), opened so that what is there
    cannot hang or redirect the reader: no symlink followed, a FIFO or device refused (not waited
    on), at most MAX_KEY_FILE bytes read. FileNotFoundError when absent; InvalidPolicy otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidPolicy(f"{path} is a symlink: a public key must be a regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidPolicy(f"{path} is not a regular file: a public key must be one")
        data = os.read(fd, MAX_KEY_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE:
        raise InvalidPolicy(f"{path} is longer than {MAX_KEY_FILE} bytes: not a public key")
    try:
        return parse_public(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidPolicy(f"{path} is not text: not a public key") from None


def _read_private(path: str) -> Ed25519PrivateKey:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidPolicy(f"{path} is a symlink: the audit signing key must be a regular file of the "
                                "daemon's (remove the link; a new key is made at start)") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidPolicy(f"{path} is not a regular file: remove it (a new key is made at start)")
        if info.st_uid != os.geteuid():
            raise InvalidPolicy(f"{path} belongs to uid {info.st_uid}, not the daemon's uid {os.geteuid()}: "
                                "whoever owns it could sign checkpoints; chown it or remove it")
        if info.st_mode & 0o077:
            raise InvalidPolicy(f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: the audit signing key must be "
                                "0600 (chmod 600 it, and make a new key if others may have read it)")
        data = os.read(fd, MAX_KEY_FILE + 1)
    finally:
        os.close(fd)
    try:
        loaded = serialization.load_pem_private_key(data, password=None)
    except ValueError as exc:
        raise InvalidPolicy(f"{path} is not a PEM private key ({exc}): remove it (a new key is made at start)") from None
    if not isinstance(loaded, Ed25519PrivateKey):
        raise InvalidPolicy(f"{path} is not an Ed25519 key: remove it (a new key is made at start)")
    return loaded


def _create(path: str) -> Ed25519PrivateKey:
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)                      # whatever the umask
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    return private


def _write_public(path: str, public: Ed25519PublicKey) -> None:
    line = public_line(public) + "\n"
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    os.replace(temporary, path)


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
