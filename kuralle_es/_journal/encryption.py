"""Encryption at rest: the ``eventsourcing`` cipher, its key checked on open (internal).

A store opened with ``KURALLE_CIPHER_KEY`` (or ``cipher_key=``) encrypts
every stored event and snapshot with ``eventsourcing``'s AES-GCM cipher,
configured the library's way (``CIPHER_TOPIC`` and ``CIPHER_KEY`` in each
log's environment), and the payload column of the view tables with the
same key. A store opened without its key, or with another, is refused with
one ``EncryptionKeyError`` before anything is written: ``check_readable``
decodes the log's first stored event (docs/privacy.md).
"""

from __future__ import annotations

import binascii
import os
from base64 import b64decode
from collections.abc import Mapping
from typing import Any

from eventsourcing.cryptography import AESCipher
from eventsourcing.persistence import Cipher, Mapper, StoredEvent
from eventsourcing.utils import Environment, get_topic

from ..errors import EncryptionKeyError

__all__ = [
    "CIPHER_KEY_ENV",
    "check_readable",
    "cipher_env",
    "cipher_of",
    "generate_cipher_key",
    "unreadable",
]

#: Our variable for the store's key; ``eventsourcing``'s own ``CIPHER_KEY`` works too.
CIPHER_KEY_ENV = "KURALLE_CIPHER_KEY"
_CIPHER_TOPIC = get_topic(AESCipher)


def generate_cipher_key() -> str:
    """A new random 256-bit key for ``KURALLE_CIPHER_KEY`` (base64 text).

    Keep it apart from the database (a secret manager): whoever holds both
    reads every run.
    """
    return AESCipher.create_key(32)


def _checked(key: str, where: str) -> str:
    """``key`` if it is base64 of 16, 24 or 32 bytes; else ``EncryptionKeyError``."""
    try:
        size = len(b64decode(key.encode("ascii"), validate=True))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        size = -1
    if size not in AESCipher.KEY_SIZES:
        msg = (
            f"{where} is not a cipher key (base64 of 16, 24 or 32 bytes); make one with "
            "kuralle_es.generate_cipher_key()"
        )
        raise EncryptionKeyError(msg)
    return key


def cipher_env(env: Mapping[str, str], cipher_key: str | None = None) -> dict[str, str]:
    """The ``eventsourcing`` cipher variables for a log: ``cipher_key``, else
    ``KURALLE_CIPHER_KEY`` of ``env`` or of the process; empty when there is no key
    or when ``env`` already names a cipher (``CIPHER_TOPIC``, the library's way)."""
    if cipher_key is not None:
        return {"CIPHER_TOPIC": _CIPHER_TOPIC, "CIPHER_KEY": _checked(cipher_key, "cipher_key")}
    if env.get("CIPHER_TOPIC"):
        return {}
    key = env.get(CIPHER_KEY_ENV) or os.environ.get(CIPHER_KEY_ENV)
    if not key:
        return {}
    return {"CIPHER_TOPIC": _CIPHER_TOPIC, "CIPHER_KEY": _checked(key, CIPHER_KEY_ENV)}


def cipher_of(env: Environment) -> Cipher | None:
    """The cipher a log's environment names (None: not encrypted)."""
    if not env.get("CIPHER_TOPIC"):
        return None
    if env.get("CIPHER_KEY"):
        _checked(str(env.get("CIPHER_KEY")), "CIPHER_KEY")
    return AESCipher(env)


def unreadable(error: BaseException, encrypted: bool) -> EncryptionKeyError:
    """The one-line refusal for a stored event this store's key cannot read."""
    if encrypted:
        msg = (
            "the store cannot be read with this cipher key: it was written with another "
            "key, or without one; open it with the key it was written with "
            f"({CIPHER_KEY_ENV} or cipher_key=)"
        )
    else:
        msg = (
            "the store is encrypted and no cipher key was given: set "
            f"{CIPHER_KEY_ENV} (or cipher_key=) to the key it was written with"
        )
    return EncryptionKeyError(msg)


def check_readable(mapper: Mapper[Any], first_event: StoredEvent | None) -> None:
    """Refuse (``EncryptionKeyError``) a store whose first stored event this mapper
    cannot decode: the wrong key, a missing one, or a key for a store written
    without one. An empty store has nothing to check."""
    if first_event is None:
        return
    state = first_event.state
    try:
        if mapper.cipher is not None:
            state = mapper.cipher.decrypt(state)
        if mapper.compressor is not None:
            state = mapper.compressor.decompress(state)
        mapper.transcoder.decode(state)
    except Exception as e:
        raise unreadable(e, mapper.cipher is not None) from None
