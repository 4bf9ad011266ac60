"""Read one counter off Prometheus text pages: the nodes' `hybridpd:kv_bytes_read_total`."""

from __future__ import annotations

import asyncio
import math

import aiohttp

KV_BYTES_READ_METRIC = "hybridpd:kv_bytes_read_total"


def _split_sample(line: str) -> tuple[str, str] | None:
    """`name{labels} value [ts]` -> (name, value text); label values may hold spaces, `}` or `\\"`."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name, i, quoted = line[:brace], brace + 1, False
        while i < len(line):
            char = line[i]
            if quoted and char == "\\":
                i += 2
                continue
            if char == '"':
                quoted = not quoted
            elif char == "}" and not quoted:
                break
            i += 1
        rest = line[i + 1:].split()
    else:
        name, *rest = line.split()
    return (name, rest[0]) if rest else None


def _declares(line: str, name: str) -> bool:
    """`# TYPE name counter` (newer clients) or `# TYPE name-without-_total counter` (older ones)."""
    words = line.split()
    family = name.removesuffix("_total")
    return len(words) >= 3 and words[:2] == ["#", "TYPE"] and words[2] in (name, family)


def counter_sum(text: str, name: str) -> float | None:
    """The sum of every sample named exactly `name` (all label sets); None if the page neither has a
    sample nor declares the counter. A labelled counter shows no sample until its first label set is
    used (a decode node before its first pull), so a declared counter without samples counts as 0."""
    total, found = 0.0, False
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            found = found or _declares(line, name)
            continue
        if not line or not line.startswith(name):
            continue
        sample = _split_sample(line)
        if sample is None or sample[0] != name:
            continue
        try:
            value = float(sample[1])
        except ValueError:
            continue
        if not math.isnan(value):
            total, found = total + value, True
    return total if found else None


async def _scrape_one(session: aiohttp.ClientSession, url: str, name: str) -> float | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status != 200:
                print(f"WARNING: {url} answered HTTP {response.status}; no {name} from it")
                return None
            return counter_sum(await response.text(), name)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        print(f"WARNING: cannot scrape {url}: {type(exc).__name__}: {exc}")
        return None


async def scrape_counters(
    session: aiohttp.ClientSession, urls: tuple[str, ...], name: str = KV_BYTES_READ_METRIC
) -> tuple[float | None, ...]:
    """One value per URL (None where the page or the metric is missing)."""
    return tuple(await asyncio.gather(*(_scrape_one(session, url, name) for url in urls)))


def counter_delta(before: tuple[float | None, ...], after: tuple[float | None, ...]) -> float | None:
    """Σ (after - before) over the pages that had the counter both times; None if none had it."""
    deltas = [b - a for a, b in zip(before, after, strict=True) if a is not None and b is not None]
    return float(sum(deltas)) if deltas else None
