"""Built-in random checkpoints (`hybridpd make-checkpoint`), and the default model generated on first use.

A preset directory holds what transformers' `save_pretrained` writes: `config.json` (its keys and its encoding of
non-finite floats, `{"__float__": "Infinity"}`), `generation_config.json`, `model.safetensors`, and a real BPE
tokenizer (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`) trained offline at creation
(preset_tokenizer.py). Shapes are in preset_shapes.py. Weights come from a fixed seed, scaled so that activations
stay O(1) and logits are spread (not uniform, not one-hot).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridpd.presets.shapes import SHAPES, VOCAB_SIZES
from hybridpd.presets.tokenizer import SPECIAL_TOKENS, write_tokenizer

if TYPE_CHECKING:  # writing a checkpoint needs torch; finding one (`default_model_dir`) does not
    import torch

    from hybridpd.engine.model.paged_lm import PagedCausalLM

DEFAULT_PRESET = "small"
SEED = 1234
# Bumped whenever what a preset writes changes: the default-model cache keys its directories by it, so a cache
# written by an older version is never served as the current preset.
FORMAT_VERSION = 3


def _with_tokenizer_ids(shape: dict[str, Any], vocab: int) -> dict[str, Any]:
    eos = vocab - len(SPECIAL_TOKENS)  # the special tokens come last, <|end_of_text|> first among them
    return shape | {"vocab_size": vocab, "eos_token_id": eos, "bos_token_id": eos}


# preset name -> its whole config.json content (as a Python dict; inf as float)
PRESETS: dict[str, dict[str, Any]] = {name: _with_tokenizer_ids(shape, VOCAB_SIZES[name])
                                      for name, shape in SHAPES.items()}


def _random_weights(model: PagedCausalLM, generator: torch.Generator) -> dict[str, torch.Tensor]:
    import torch

    def normal(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std + mean

    def uniform(shape: torch.Size, low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=generator) * (high - low) + low

    weights = {}
    for name, param in model.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight") or name.endswith("embeddings.weight"):
            value = normal(param.shape, 0.15)
        elif name == "lm_head.weight":
            value = normal(param.shape, 2.5 / math.sqrt(param.shape[-1]))
        elif name.rsplit(".", 2)[-2].startswith("norm") or name.endswith("layernorm.weight"):
            value = normal(param.shape, 0.1, mean=1.0)
        elif name.endswith("conv1d.weight"):
            value = normal(param.shape, 0.5)
        elif leaf in ("bias", "e_score_correction_bias"):
            value = normal(param.shape, 0.1)
        elif leaf == "dt_bias":  # softplus(dt_bias) in [0.01, 0.2]
            dt = torch.exp(uniform(param.shape, math.log(0.01), math.log(0.2)))
            value = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "A_log":
            value = torch.log(uniform(param.shape, 1.0, 8.0))
        elif leaf == "D":
            value = normal(param.shape, 0.1, mean=1.0)
        else:  # projections: fan-in scaled
            value = normal(param.shape, 1.0 / math.sqrt(param.shape[-1]))
        weights[name] = value.contiguous()
    return weights


def _json_value(value: Any) -> Any:
    """transformers' JSON encoding: non-finite floats as {"__float__": "Infinity"} (strict JSON has none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return value


def write_checkpoint(preset: str, out: Path) -> Path:
    """Write the preset's whole directory into `out` (created if needed); return `out`."""
    import torch
    from safetensors.torch import save_file

    from hybridpd.engine.model.registry import family_for

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    raw = PRESETS[preset]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(out, VOCAB_SIZES[preset], raw["max_position_embeddings"])
    if (tokenizer.vocab_size, tokenizer.eos_token_id) != (raw["vocab_size"], raw["eos_token_id"]):
        raise RuntimeError(f"preset {preset}: the trained tokenizer has {tokenizer.vocab_size} tokens and eos "
                           f"{tokenizer.eos_token_id}, the config says {raw['vocab_size']} and {raw['eos_token_id']}")
    family = family_for(raw)
    model = family.build(family.parse_config(raw), torch.float32)
    weights = _random_weights(model, torch.Generator().manual_seed(SEED))
    if raw.get("tie_word_embeddings"):
        weights.pop("lm_head.weight")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_json_value(raw), indent=2) + "\n")
    generation = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"],
                  "pad_token_id": raw.get("pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def default_model_dir(preset: str = DEFAULT_PRESET, cache_root: Path | None = None) -> Path:
    """The preset's checkpoint under `cache_root` ($HYBRIDPD_CACHE, else ~/.cache/hybridpd), made on first use.

    Kept under `<preset>-v<FORMAT_VERSION>`, so an older version's directory is never served. Written into a
    temporary sibling directory and renamed into place, so a reader never sees half a checkpoint; when two
    processes race, the loser's copy is discarded.
    """
    if cache_root is None:
        env = os.environ.get("HYBRIDPD_CACHE")
        cache_root = Path(env) if env else Path.home() / ".cache" / "hybridpd"
    target = Path(cache_root) / f"{preset}-v{FORMAT_VERSION}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=target.parent))
    try:
        write_checkpoint(preset, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET, help="model shape")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the checkpoint into")


def run(args: argparse.Namespace) -> int:
    out = write_checkpoint(args.preset, args.out)
    print(f"wrote the {args.preset} checkpoint to {out}")
    return 0
