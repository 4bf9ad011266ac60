"""What names a block file: the groups a store holds pages of, the folder of their layout, and a file's path
(`<folder>/<hash[:2]>/<hash>.<groups>.kv`, hex; `groups` is the bit mask of the groups whose pages the file holds),
written and parsed."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupLayout:
    key: bytes         # identity.group_key
    page_bytes: int    # the payload of one block


def layout_key(groups: Sequence[GroupLayout]) -> bytes:
    """The digest of every group's key, in order: the bits of a file's groups mean the same to every store of it."""
    return hashlib.blake2b(b"".join(g.key for g in groups), digest_size=16).digest()


def block_path(folder: str, block_hash: bytes, groups: int) -> str:
    name = block_hash.hex()
    return f"{folder}/{name[:2]}/{name}.{groups:x}.kv"


def parse_block_name(name: str, all_groups: int) -> tuple[bytes, int] | None:
    """(block hash, groups) of a block file's name whose groups lie within `all_groups`; None for any other name."""
    if not name.endswith(".kv"):
        return None
    hash_hex, _, groups_hex = name[:-3].partition(".")
    try:
        block_hash, groups = bytes.fromhex(hash_hex), int(groups_hex, 16)
    except ValueError:
        return None
    if not block_hash or not 0 < groups <= all_groups or groups_hex != f"{groups:x}":
        return None
    return block_hash, groups


def mask(groups: Iterable[int]) -> int:
    """The bit mask of group indices."""
    return sum({1 << group for group in groups})


def members(groups: int) -> list[int]:
    """The group indices of a bit mask, ascending."""
    return [g for g in range(groups.bit_length()) if groups >> g & 1]


def union(masks: Iterable[int]) -> int:
    result = 0
    for groups in masks:
        result |= groups
    return result


def largest_first(masks: Iterable[int]) -> tuple[int, ...]:
    """Sets of groups, those with the most groups first."""
    return tuple(sorted(masks, key=lambda groups: (-groups.bit_count(), groups)))
