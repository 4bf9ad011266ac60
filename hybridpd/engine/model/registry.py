"""Model families: architecture name (config.json's `architectures`) -> how to read its config and build its model.

Everything outside `engine/model/` sees a family only through `ModelConfig` (the fields the engine reads) and the
model's `PagedCausalLM` interface (`kv_cache_specs`, `forward`); adding a family is one entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import torch

from hybridpd.engine.model.falcon_h1.config import FalconH1Config
from hybridpd.engine.model.falcon_h1.model import FalconH1LM
from hybridpd.engine.model.granite.config import GraniteConfig
from hybridpd.engine.model.granite.model import GraniteLM
from hybridpd.engine.model.nemotron_h.model import NemotronHLM
from hybridpd.engine.model.nemotron_h.config import NemotronHConfig
from hybridpd.engine.model.paged_lm import PagedCausalLM


class ModelConfig(Protocol):
    """What the engine reads from any family's config."""

    vocab_size: int
    max_position_embeddings: int
    mamba_chunk_size: int
    eos_token_ids: tuple[int, ...]   # every listed id stops generation
    bos_token_id: int | None
    has_mamba: bool
    tie_word_embeddings: bool        # the head shares the embedding's weight (a checkpoint may then omit it)
    checkpoint_dtype: str            # the dtype the weights were saved in


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    architecture: str
    parse_config: Callable[[dict[str, Any]], ModelConfig]     # ValueError naming the key, value and what is supported
    build: Callable[[Any, torch.dtype], PagedCausalLM]


FAMILIES: Mapping[str, ModelFamily] = MappingProxyType({
    family.architecture: family for family in (
        ModelFamily(architecture="GraniteMoeHybridForCausalLM", parse_config=GraniteConfig.from_dict, build=GraniteLM),
        ModelFamily(architecture="NemotronHForCausalLM", parse_config=NemotronHConfig.from_dict, build=NemotronHLM),
        ModelFamily(architecture="FalconH1ForCausalLM", parse_config=FalconH1Config.from_dict, build=FalconH1LM),
    )
})
_MODEL_TYPES = {"granitemoehybrid": "GraniteMoeHybridForCausalLM", "nemotron_h": "NemotronHForCausalLM",
                "falcon_h1": "FalconH1ForCausalLM"}


def family_for(raw: dict[str, Any]) -> ModelFamily:
    """The family named by `architectures` (else by `model_type`; a config with neither is read as Granite)."""
    architectures = raw.get("architectures")
    if architectures is None:
        model_type = raw.get("model_type", "granitemoehybrid")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(_MODEL_TYPES)}")
        return FAMILIES[_MODEL_TYPES[model_type]]
    if not isinstance(architectures, list):
        raise ValueError(f"architectures must be a list, got {architectures!r}")
    for name in architectures:
        if name in FAMILIES:
            return FAMILIES[name]
    raise ValueError(f"architectures {architectures} is not supported; supported: {sorted(FAMILIES)}")
