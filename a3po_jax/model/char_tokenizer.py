"""A character-level tokenizer for tiny random models (tests and smoke runs).

Model layer (pure core): imports only the core, model and parallel layers.

Real runs use the checkpoint's own tokenizer. This one needs no files: ids 0-2 are
``<pad>``, ``<|im_start|>`` and ``<|im_end|>`` (EOS, as in SmolLM2's ChatML), then printable
ASCII and newline, one id per character, so it fits ``ModelConfig.tiny()``'s vocabulary of 128.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from a3po_jax.model.chat_template import CHATML_TEMPLATE

SPECIAL_TOKENS = ("<pad>", "<|im_start|>", "<|im_end|>")
CHARACTERS = "\n" + "".join(c for c in string.printable if c.isprintable())


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A ChatML character tokenizer with a vocabulary of 3 + 96 = 99 ids."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    # Split into single characters ("isolated" keeps each as its own piece).
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="?",
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok
