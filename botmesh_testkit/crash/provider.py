"""Providers of the crash world: :class:`ChannelProvider` passes everything to a channel
that outlives the bot, :class:`CrashableProvider` dies with its
:class:`~botmesh_testkit.crash.wrapper.CrashableBackend` (TEST-2)."""

from __future__ import annotations

from typing import Any

from botmesh.core.provider import Content, Provider

from .points import PROVIDER_SEND
from .wrapper import CrashableBackend


class ChannelProvider(Provider):
    """A provider that passes everything to ``channel`` (a ``MockProvider`` by default),
    which stands for the outside world shared by successive bot incarnations: what it
    recorded was delivered, whatever happens to the bot later."""

    def __init__(self, channel: Provider | None = None) -> None:
        super().__init__()
        from botmesh.core.testing import MockProvider

        self.channel = channel if channel is not None else MockProvider()
        self.name = self.channel.name
        self.text_limit = self.channel.text_limit
        self.serialize_media_ref = self.channel.serialize_media_ref
        self.rehydrate_media_ref = self.channel.rehydrate_media_ref

    async def send(self, chat_id: str, content: Content) -> str:
        return await self.channel.send(chat_id, content)

    async def typing(self, chat_id: str) -> None:
        await self.channel.typing(chat_id)

    async def download_media(self, ref: Any) -> bytes:
        return await self.channel.download_media(ref)


class CrashableProvider(ChannelProvider):
    """A provider that dies with its :class:`CrashableBackend` (TEST-2).

    Its own crash point is ``"provider.send"``: *before* means the call never reached the
    channel; *after* means the channel accepted the message and the process died before
    the answer came back.
    """

    def __init__(self, crashable: CrashableBackend, channel: Provider | None = None) -> None:
        super().__init__(channel)
        self.crashable = crashable

    async def send(self, chat_id: str, content: Content) -> str:
        nth, total = self.crashable.enter(PROVIDER_SEND)
        try:
            message_id = await self.channel.send(chat_id, content)
        except Exception:
            self.crashable.failed(PROVIDER_SEND, nth)
            raise
        self.crashable.leave(PROVIDER_SEND, nth, total)
        return message_id

    async def typing(self, chat_id: str) -> None:
        self.crashable.check_alive()
        await super().typing(chat_id)

    async def download_media(self, ref: Any) -> bytes:
        self.crashable.check_alive()
        return await super().download_media(ref)
