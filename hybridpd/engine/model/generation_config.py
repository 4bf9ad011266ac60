"""`generation_config.json`: the checkpoint's sampling defaults, as vLLM applies them (`--generation-config auto`).

A request that omits `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `presence_penalty`,
`frequency_penalty` or `max_tokens` gets the checkpoint's value (`max_new_tokens` for `max_tokens`) instead of the
OpenAI default, the fields vLLM takes from the file; `eos_token_id` there adds stop ids to config.json's. A checkpoint
without the file keeps the OpenAI defaults (temperature 1, top_p 1, no top-k, 16 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridpd.engine.model.config_fields import read_checkpoint_json
from hybridpd.errors import CheckpointError

FILE = "generation_config.json"


@dataclass(frozen=True, kw_only=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerationDefaults:
        def number(key: str, kind: type, check) -> Any:
            value = raw.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and int(value) != value):
                raise ValueError(f"{FILE}: {key} must be a number, got {value!r}")
            if not check(value):
                raise ValueError(f"{FILE}: {key} {value!r} is out of range")
            return kind(value)

        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in eos_ids):
            raise ValueError(f"{FILE}: eos_token_id must be a non-negative integer or a list of them, got {eos!r}")
        return cls(  # as vLLM: `do_sample` is not read, only the sampling values themselves
            temperature=number("temperature", float, lambda v: v >= 0),
            top_p=number("top_p", float, lambda v: 0 < v <= 1),
            top_k=number("top_k", int, lambda v: v >= -1),
            min_p=number("min_p", float, lambda v: 0 <= v <= 1),
            repetition_penalty=number("repetition_penalty", float, lambda v: v > 0),
            presence_penalty=number("presence_penalty", float, lambda v: -2 <= v <= 2),
            frequency_penalty=number("frequency_penalty", float, lambda v: -2 <= v <= 2),
            max_tokens=number("max_new_tokens", int, lambda v: v >= 1),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> GenerationDefaults:
        path = Path(model_dir) / FILE
        if not path.is_file():
            return cls()
        raw = read_checkpoint_json(path)
        try:
            return cls.from_dict(raw)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
