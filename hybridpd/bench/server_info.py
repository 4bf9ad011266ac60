"""What the benchmark asks the server before it starts: the served model and its vocabulary size."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from hybridpd.errors import HybridPDError


class ServerInfoError(HybridPDError):
    """GET /v1/models failed or listed no model; the message says what to check."""


@dataclass(frozen=True, kw_only=True)
class ModelCard:
    model_id: str
    vocab_size: int | None   # the card's `vocab_size` when the server reports it (OpenAI's card has none)


async def fetch_model_card(session: aiohttp.ClientSession, base_url: str) -> ModelCard:
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
            if response.status != 200:
                raise ServerInfoError(f"GET {url} answered HTTP {response.status}")
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise ServerInfoError(f"cannot read the served model from {url}: {type(exc).__name__}: {exc}") from None
    models = body.get("data") if isinstance(body, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ServerInfoError(f"{url} lists no model; is the server up and serving one?")
    vocab = models[0].get("vocab_size")
    return ModelCard(
        model_id=str(models[0]["id"]),
        vocab_size=vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None,
    )
