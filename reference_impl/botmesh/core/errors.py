"""The error tree of botmesh. Everything the project raises derives from
:class:`BotmeshError`; drivers' errors are translated at the backend boundary so that
callers (and the conformance suite) can assert on these types alone."""

from __future__ import annotations

from typing import Any

from .spi_types import Versioned


class BotmeshError(Exception):
    """Root of every error raised by botmesh.

    ``code`` is a stable, machine-readable identifier (``"APPEND_LOG_CORRUPT"``,
    ``"CONFIG_INVALID"`` ...); ``details`` carries structured context (file, line, option).
    """

    code: str = "BOTMESH_ERROR"

    def __init__(self, message: str, *, code: str | None = None, **details: Any) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.details: dict[str, Any] = details
        for name, value in details.items():
            if not hasattr(type(self), name):
                setattr(self, name, value)


class ConfigError(BotmeshError):
    """A bad option, duration or type given when a bot or backend is built. ``option``
    names the setting at fault (e.g. ``"durability.outbox.lease_ms"``)."""

    code = "CONFIG_INVALID"


class InvalidArgumentError(BotmeshError, ValueError):
    """An argument the API does not accept (an idempotency key, an inbound id, an index
    score ...), refused before any backend sees it, so that every backend refuses it the
    same way. ``argument`` names it (``"idempotency_key"``, ``"event.id"``, ``"due"``),
    ``value`` is what was given. It is a :class:`ValueError` too (issue 13)."""

    code = "ARGUMENT_INVALID"


class InvalidKeyError(InvalidArgumentError):
    """A key or id outside what the journals store (:mod:`botmesh.core.inputs`): not a
    ``str``, empty, too long, not valid Unicode (a lone surrogate) or holding U+0000.
    ``argument`` names it, ``value`` is what was given."""

    code = "KEY_INVALID"


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (a score that is a ``str`` ...): a ``TypeError`` as
    well as a ``ValueError``, so that either ``except`` catches it."""


class InvalidKeyTypeError(InvalidKeyError, InvalidArgumentTypeError):
    """A key or id that is not a ``str`` at all (an ``int``, ``bytes`` ...): also a
    ``TypeError``."""


class DurabilityError(BotmeshError):
    """A durability backend could not do what was asked."""

    code = "DURABILITY_ERROR"


class BackendUnavailableError(DurabilityError):
    """The backend cannot be reached or refused the operation (I/O error, server down,
    closed). The operation may or may not have taken effect only where the method's
    contract says so."""

    code = "BACKEND_UNAVAILABLE"


class VersionConflict(DurabilityError):
    """A compare-and-set of :class:`botmesh.core.spi.DurableKv` found another version
    than the one expected (or a record where none was expected).

    ``key``, ``expected`` and ``found`` (the version found, 0: absent) are set by
    :meth:`at`, which every built-in kv uses.
    ``current`` is optional (issue 16): the record the kv found — its value and version,
    read in the same server round trip as the failed compare-and-set — when the kv
    reports it; ``None`` when the record was absent (``found == 0``) or the kv does not
    report it. With ``current`` a caller can retry against ``current.version`` without
    reading the record again. It is the caller's own copy (mutating it changes nothing
    stored), and ``current.version == found``.
    """

    code = "KV_CONFLICT"
    key: str  # annotations only: BotmeshError sets them from the details given to at()
    expected: int
    found: int
    current: Versioned | None = None

    @classmethod
    def at(
        cls, space: str, key: str, expected: int, found: int, current: Versioned | None = None
    ) -> VersionConflict:
        """The conflict every DurableKv raises: ``space/key: expected version E, found F``;
        ``current`` (optional) is the record found (``ValueError`` when its version is not
        ``found``: a kv bug)."""
        error = cls(f"{space}/{key}: expected version {expected}, found {found}", key=key, expected=expected, found=found)
        if current is not None:
            if current.version != found:
                raise ValueError(f"{space}/{key}: VersionConflict found {found} but current is at {current.version}")
            error.current = current
        return error


class KvContractError(DurabilityError):
    """A :class:`~botmesh.core.spi.DurableKv` answered against its contract in a way that
    would make its caller loop forever (``scan(after=k)`` listing ``k`` again, or a key
    before it). ``method`` names the kv method, ``key`` the key at fault."""

    code = "KV_CONTRACT"


class JournalCorruptError(DurabilityError):
    """A journal cannot be read back. ``file`` names the file; for a damaged append-log
    entry in the middle of the log ``code`` is ``"APPEND_LOG_CORRUPT"`` and ``line`` /
    ``byte`` give the position (BACK-5)."""

    code = "JOURNAL_CORRUPT"


class JournalLockedError(DurabilityError):
    """A file journal is already open in a live process, or in this one (BACK table)."""

    code = "JOURNAL_LOCKED"


class SendDeferredError(BotmeshError):
    """``ctx.reply``/``bot.send`` gave up retrying inline after ``outbox.inline_max_ms``
    (OUT-9). The send is not lost: the background sweep keeps retrying it under ``key``.

    ``key`` is the send's key (the one given or derived, OUT-3) also when the text was
    split and a later part is the one deferred; ``part_key`` is the key of the part's
    record that is waiting (``key`` itself for the first part)."""

    code = "SEND_DEFERRED"

    def __init__(self, key: str, cause: BaseException | None = None, *, part_key: str | None = None) -> None:
        part = part_key if part_key is not None else key
        where = "" if part == key else f", part {part!r}"
        super().__init__(f"send deferred to the background sweep (outbox key {key!r}{where})")
        self.key = key
        self.part_key = part
        self.__cause__ = cause


class SendFailedError(BotmeshError):
    """A journaled send went to the dead-letter queue (definitive error or retries
    exhausted). ``key`` is its outbox key — the send's, also when a later part of a split
    text died; ``part_key`` is the key of the part's record that died (``key`` itself for
    the first part)."""

    code = "SEND_DEAD"

    def __init__(self, key: str, error: str, cause: BaseException | None = None, *, part_key: str | None = None) -> None:
        part = part_key if part_key is not None else key
        where = "" if part == key else f" (part {part!r})"
        super().__init__(f"send {key!r}{where} is dead: {error}")
        self.key = key
        self.part_key = part
        self.error = error
        self.__cause__ = cause
