"""A character-level tokenizer for tiny random models (tests and smoke runs).

Model layer (pure core): imports only the core, model and parallel layers.

Real runs use the checkpoint's own tokenizer. This one needs no files: ids 0-2 are
``<pad>``, ``<|im_start|>`` and ``<|im_end|>`` (EOS, as in SmolLM2's ChatML), then printable
ASCII and newline, one id per character, so it fits ``ModelConfig.tiny()``'s vocabulary of 128.

It is the `tokenizers` backend that transformers' fast tokenizer would wrap, with the part of
that tokenizer's interface the project calls (``encode``, ``decode``, ``apply_chat_template``,
``save_pretrained``, the special tokens' ids), so a run of a tiny model never imports
transformers (docs/development.md, "Measured"). ``save_pretrained`` writes the files
transformers writes, and ``transformers.AutoTokenizer`` loads them into a tokenizer that
encodes, decodes and renders alike (``tests/model/test_char_tokenizer.py``).
"""

from __future__ import annotations

import functools
import json
import operator
import os
import string
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from a3po_jax.model.chat_template import CHATML_TEMPLATE

SPECIAL_TOKENS = ("<pad>", "<|im_start|>", "<|im_end|>")
CHARACTERS = "\n" + "".join(c for c in string.printable if c.isprintable())
# The roles of the special tokens, as transformers names them in tokenizer_config.json.
ROLES = {"pad_token": "<pad>", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
UNK_TOKEN = "?"  # a character of the vocabulary, as transformers registers it: special


class CharTokenizer:
    """A ChatML character tokenizer with a vocabulary of 3 + 96 = 99 ids."""

    pad_token, bos_token, eos_token = ROLES["pad_token"], ROLES["bos_token"], ROLES["eos_token"]
    unk_token = UNK_TOKEN

    def __init__(self) -> None:
        vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        for ch in CHARACTERS:
            vocab.setdefault(ch, len(vocab))
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
        # Split into single characters ("isolated" keeps each as its own piece).
        backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
        # Special tokens match as one id inside text (a rendered chat prompt holds them).
        backend.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t in (*SPECIAL_TOKENS, UNK_TOKEN)]
        )
        self.backend = backend
        self.chat_template = CHATML_TEMPLATE

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.backend.token_to_id(token)

    pad_token_id = property(lambda self: self.convert_tokens_to_ids(self.pad_token))
    bos_token_id = property(lambda self: self.convert_tokens_to_ids(self.bos_token))
    eos_token_id = property(lambda self: self.convert_tokens_to_ids(self.eos_token))
    unk_token_id = property(lambda self: self.convert_tokens_to_ids(self.unk_token))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes one string, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        try:  # one id: a Python or NumPy integer, or a 0-d integer array
            ids = [operator.index(ids)]
        except TypeError:
            ids = [int(i) for i in ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: Sequence[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
    ) -> str | list[int]:
        """The conversation rendered by the (given or own) Jinja chat template, as text or,
        with ``tokenize``, as ids (no special tokens added: the template writes its own)."""
        template = _compiled_template(chat_template or self.chat_template)
        text = template.render(
            messages=[dict(m) for m in conversation],
            add_generation_prompt=add_generation_prompt,
            **ROLES,
            unk_token=self.unk_token,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, path: str | os.PathLike) -> tuple[str, ...]:
        """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja, the files
        transformers' fast tokenizer writes; returns their paths."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = {
            "backend": "tokenizers",
            **ROLES,
            "model_max_length": int(1e30),  # transformers' "no limit"
            "tokenizer_class": "TokenizersBackend",
            "unk_token": self.unk_token,
        }
        files = {
            "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
            "chat_template.jinja": self.chat_template,
            "tokenizer.json": self.backend.to_str(pretty=True),
        }
        for name, text in files.items():
            (path / name).write_text(text)
        return tuple(str(path / name) for name in files)


def char_tokenizer() -> CharTokenizer:
    """A ChatML character tokenizer with a vocabulary of 3 + 96 = 99 ids."""
    return CharTokenizer()


@functools.cache
def _compiled_template(template: str):
    # The environment transformers renders chat templates in (sandboxed, trimmed blocks).
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
