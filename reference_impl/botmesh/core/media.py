"""Media references in a replay (MEDIA-1..5)."""

from __future__ import annotations

import json
from typing import Any

from .host import HandlerContext, ReplayedMedia
from .provider import MediaUnavailableError, Provider, ProviderError

__all__ = ["ReplayedMedia", "journal_media", "load_media_of", "rehydrate"]


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


def rehydrate(provider: Provider, journaled: dict[str, Any] | None) -> ReplayedMedia | None:
    """Rebuild a journaled reference before a replayed handler runs (MEDIA-2). Never
    raises: a failure is kept and reported by :func:`load_media_of` (MEDIA-3)."""
    if journaled is None:
        return None
    if "raw" in journaled:
        return ReplayedMedia(ref=journaled["raw"])
    if journaled.get("not_durable"):
        return ReplayedMedia(reason="not-durable")
    stored = journaled.get("durable")
    if not isinstance(stored, dict):
        return ReplayedMedia(reason="rehydrate-failed", detail="malformed journal entry")
    if stored.get("provider") != provider.name:
        return ReplayedMedia(reason="provider-mismatch", detail=f"written by {stored.get('provider')!r}")
    if provider.rehydrate_media_ref is None:
        return ReplayedMedia(reason="rehydrate-failed", detail=f"{provider.name} cannot rehydrate media")
    try:
        ref = provider.rehydrate_media_ref({"v": stored.get("v"), "data": stored.get("data")}, None)
    except ProviderError as exc:
        return ReplayedMedia(reason="rehydrate-failed", detail=str(exc))
    return ReplayedMedia(ref=ref)


async def load_media_of(ctx: HandlerContext, *, throw_on_error: bool = False) -> bytes | None:
    """Download the media of the message being handled. For a replayed message whose
    reference could not be rebuilt, raise :class:`MediaUnavailableError` with its
    ``reason`` when ``throw_on_error``, else return None (MEDIA-3)."""
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
    except ProviderError as exc:
        if throw_on_error:
            if isinstance(exc, MediaUnavailableError):
                raise
            raise MediaUnavailableError("rehydrate-failed", str(exc)) from exc
        return None
