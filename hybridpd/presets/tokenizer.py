"""The presets' tokenizer: a byte-level BPE trained offline, at preset creation, on text this module generates.

Deterministic (a fixed seed, a fixed word list, one training thread's worth of data: well under a second), written
as transformers reads it: `tokenizer.json` (the `tokenizers` library's own format), `tokenizer_config.json` (special
tokens, `add_bos_token`, `tokenizer_class`) and `chat_template.jinja` in Granite-4.0's chat format. Byte-level, so
every string has an encoding: the 256 byte symbols come first, then the merges, then the special tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS, ROLE_START, ROLE_END, PAD = "<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|pad|>"
SPECIAL_TOKENS = (EOS, ROLE_START, ROLE_END, PAD)
# Granite 4.0's chat format: with tools, a system turn lists them and asks for `<tool_call>` JSON (what the `granite4`
# tool-call parser reads); an assistant's calls follow its content in that form; a tool's answer is a user turn in
# `<tool_response>` tags.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|start_of_role|>system<|end_of_role|>You are a helpful assistant with access to the following tools. You "
    "may call one or more tools to assist with the user query.\\n\\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each tool call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|end_of_text|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|start_of_role|>user<|end_of_role|><tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|end_of_text|>\\n' }}"
    "{%- else %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>\\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|end_of_text|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)
_WORDS = (
    "the a an of to and in is it that for on with as was at by be this are from or have not but what all were when "
    "we there can your which their said if do will each about how up out them then she many some so these would "
    "other into has more her two like him see time could no make than first been its who now people my made over "
    "did down only way find use may water long little very after words called just where most know get through "
    "back much before go good new write our used me man too any day same right look think also around another came "
    "come work three word must because does part even place well such here take why things help put years different "
    "away again off went old number great tell men say small every found still between name should home big give air "
    "line set own under read last never us left end along while might next sound below saw something thought both few "
    "those always looked show large often together asked house world going want school important until form food keep "
    "children feet land side without boy once animals life enough took sometimes four head above kind began almost "
    "live page got earth need far hand high year mother light parts country father let night following picture being "
    "study second eyes soon times story boys since white days ever paper hard near sentence better best across during "
    "today others however sure means knew try told young miles sun ways thing whole hear example heard several change "
    "answer room sea against top turned learn point city play toward five using himself usually cache block prefill "
    "decode token model layer window state stream request node proxy engine memory attention mamba hybrid"
).split()


@dataclass(frozen=True, kw_only=True)
class TokenizerFiles:
    vocab_size: int          # ids the tokenizer can produce (the model's vocab_size is at least this)
    eos_token_id: int
    bos_token_id: int


def training_text(seed: int, sentences: int) -> list[str]:
    """Sentences of common English words with punctuation, digits, some capitals and a little non-ASCII text."""
    rng = random.Random(seed)
    extras = ("café", "naïve", "über", "日本語", "—", "€5", "½")
    lines = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2025)))
        if rng.random() < 0.05:
            words.insert(rng.randrange(len(words)), rng.choice(extras))
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice((".", ".", ".", "?", "!", ",")))
    return lines


def train(vocab_size: int, seed: int = 7) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_text(seed, sentences=max(2000, vocab_size * 4)), trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> TokenizerFiles:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja into `out`."""
    tokenizer = train(vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    eos = tokenizer.token_to_id(EOS)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return TokenizerFiles(vocab_size=tokenizer.get_vocab_size(), eos_token_id=eos, bos_token_id=eos)
