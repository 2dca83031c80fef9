"""Media references in a replay (MEDIA-1..5).

What a replay does with what the inbox journaled under ``event["media"]``
(:func:`rehydrate`); it never raises, so a bad reference never costs the message
(MEDIA-3: the message is processed, only its download fails):

* ``{"durable": {"provider", "v", "data"}}`` (MEDIA-1): rebuilt by the provider's
  ``rehydrate_media_ref``; written by another provider: ``provider-mismatch``; invalid,
  tampered with, or the provider's rehydration fails in any way (a ``ProviderError`` as
  the contract says, or any other exception of a buggy provider): ``rehydrate-failed``.
  An envelope whose ``durable`` entry is not an object is ``rehydrate-failed`` too.
* ``{"not_durable": True}``: ``not-durable``.
* ``{"raw": token}`` (MEDIA-5, ``inbox.media_refs=False``): the token, as it is.
* Anything else — a bare token (a string, a number, a list, or an object that is not one
  of the envelopes above, each of which has exactly one key) — is a record written before
  the feature: it replays as before (MEDIA-5), the token handed to the provider's
  download as it is. A provider that can no longer download it fails the download, which
  :func:`load_media_of` reports like any failed download.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .host import HandlerContext, ReplayedMedia
from .provider import MediaUnavailableError, Provider, ProviderError

__all__ = ["ReplayedMedia", "journal_media", "load_media_of", "rehydrate"]

log = logging.getLogger("botmesh.durability")

_ENVELOPES = ("raw", "not_durable", "durable")
"""The keys of the envelopes :func:`journal_media` writes, one each."""


def journal_media(provider: Provider, media: Any, media_refs: bool) -> dict[str, Any] | None:
    """What the inbox journals for an inbound event's media (never the bytes, MEDIA-1).

    * ``media_refs`` and the provider serializes: ``{"durable": {"provider", "v", "data"}}``;
      ``None`` from ``serialize_media_ref`` gives ``{"not_durable": True}``.
    * Otherwise the raw token (MEDIA-5), when it is JSON: ``{"raw": token}``.
    """
    if media is None:
        return None
    if media_refs and provider.serialize_media_ref is not None:
        stored = provider.serialize_media_ref(media)
        if stored is None:
            return {"not_durable": True}
        if not isinstance(stored, dict) or "v" not in stored or "data" not in stored:
            raise ProviderError(f"{provider.name}.serialize_media_ref returned {stored!r}, expected {{'v', 'data'}}")
        return {"durable": {"provider": provider.name, "v": stored["v"], "data": stored["data"]}}
    try:
        json.dumps(media)
    except (TypeError, ValueError):
        return {"not_durable": True}
    return {"raw": media}


def _is_envelope(journaled: Any) -> bool:
    return isinstance(journaled, dict) and len(journaled) == 1 and next(iter(journaled)) in _ENVELOPES


def rehydrate(provider: Provider, journaled: Any) -> ReplayedMedia | None:
    """Rebuild a journaled reference before a replayed handler runs (MEDIA-2). Never
    raises: a failure is kept and reported by :func:`load_media_of` (MEDIA-3); see the
    module's docstring for each form."""
    if journaled is None:
        return None
    if not _is_envelope(journaled):  # MEDIA-5: written before the feature, replays as before
        return ReplayedMedia(ref=journaled)
    if "raw" in journaled:
        return ReplayedMedia(ref=journaled["raw"])
    if "not_durable" in journaled:
        return ReplayedMedia(reason="not-durable")
    stored = journaled["durable"]
    if not isinstance(stored, dict):
        return ReplayedMedia(reason="rehydrate-failed", detail=f"malformed journal entry {stored!r:.80}")
    if stored.get("provider") != provider.name:
        return ReplayedMedia(reason="provider-mismatch", detail=f"written by {stored.get('provider')!r}")
    if provider.rehydrate_media_ref is None:
        return ReplayedMedia(reason="rehydrate-failed", detail=f"{provider.name} cannot rehydrate media")
    try:
        ref = provider.rehydrate_media_ref({"v": stored.get("v"), "data": stored.get("data")}, None)
    except ProviderError as exc:
        return ReplayedMedia(reason="rehydrate-failed", detail=str(exc))
    except Exception as exc:  # a provider that breaks its contract must not cost the message
        log.warning("%s.rehydrate_media_ref raised %r instead of a ProviderError", provider.name, exc)
        return ReplayedMedia(reason="rehydrate-failed", detail=f"{type(exc).__name__}: {exc}")
    return ReplayedMedia(ref=ref)


async def load_media_of(ctx: HandlerContext, *, throw_on_error: bool = False) -> bytes | None:
    """Download the media of the message being handled. When it cannot be had — a
    replayed message whose reference could not be rebuilt, or a download that failed in
    any way — raise :class:`MediaUnavailableError` with its ``reason`` when
    ``throw_on_error`` (a failed download is ``rehydrate-failed`` unless the provider
    raised a ``MediaUnavailableError`` of its own), else return None (MEDIA-3). A
    cancellation is never swallowed."""
    replayed = ctx.replayed_media
    if replayed is not None and replayed.reason is not None:
        if throw_on_error:
            raise MediaUnavailableError(replayed.reason, replayed.detail)
        return None
    ref = replayed.ref if replayed is not None else ctx.event.media
    if ref is None:
        if throw_on_error:
            raise MediaUnavailableError("not-durable", "the message has no media")
        return None
    try:
        return await ctx.bot.provider.download_media(ref)
    except Exception as exc:  # "like any failed download" (MEDIA-3)
        if throw_on_error:
            if isinstance(exc, MediaUnavailableError):
                raise
            raise MediaUnavailableError("rehydrate-failed", f"download failed: {type(exc).__name__}: {exc}") from exc
        return None
