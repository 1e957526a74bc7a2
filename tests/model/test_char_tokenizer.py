"""The character tokenizer without transformers is the tokenizer transformers' fast class
built from the same backend: same backend, ids, text, chat prompts and saved files; and a
tiny model loads without importing transformers."""

import json
import random

import numpy as np
import pytest
from helpers.python_snippet import run_snippet
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from a3po_jax.model.char_tokenizer import CHARACTERS, SPECIAL_TOKENS, char_tokenizer
from a3po_jax.model.chat_template import CHATML_TEMPLATE

TEXTS = [
    "",
    "Hi ? there . , 's n't",  # "?" is the unknown token and a character; spaced punctuation
    "<|im_start|>user\nab<|im_end|>\n<pad>x",  # special tokens inside text
    "caf\u00e9 \u2603 \t tab",  # characters outside the vocabulary
    "12+7=19, ab",
]


def _transformers_char_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer as transformers' fast class builds it from the backend."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
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


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pieces = [*CHARACTERS, *SPECIAL_TOKENS, "\u00e9", " ."]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def both():
    return char_tokenizer(), _transformers_char_tokenizer()


def test_the_backend_is_the_one_transformers_holds(both):
    ours, theirs = both
    assert json.loads(ours.backend.to_str()) == json.loads(theirs._tokenizer.to_str())
    assert (len(ours), ours.vocab_size, ours.get_vocab()) == (
        len(theirs),
        theirs.vocab_size,
        theirs.get_vocab(),
    )
    for role in ("pad", "bos", "eos", "unk"):
        assert getattr(ours, f"{role}_token_id") == getattr(theirs, f"{role}_token_id"), role
        assert getattr(ours, f"{role}_token") == getattr(theirs, f"{role}_token"), role
    assert ours.eos_token_id == 2 and len(ours) == 99


@pytest.mark.parametrize("text", TEXTS + _random_texts(40))
def test_ids_and_text_are_transformers(both, text):
    ours, theirs = both
    for add in (True, False):
        assert ours.encode(text, add_special_tokens=add) == theirs.encode(
            text, add_special_tokens=add
        )
    ids = ours.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip
        )
    if ids:
        assert ours.decode(ids[0]) == theirs.decode(ids[0])
        # One id as NumPy gives it (an element of an array, a 0-d array) and an int array.
        assert (
            ours.decode(np.int32(ids[0])) == ours.decode(np.asarray(ids[0])) == ours.decode(ids[0])
        )
        assert ours.decode(np.asarray(ids, np.int32)) == ours.decode(ids)


def test_chat_prompts_are_transformers(both):
    ours, theirs = both
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Which letter? a"},
    ]
    for gen in (True, False):
        kwargs = dict(add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(conversation, **kwargs) == theirs.apply_chat_template(
            conversation, **kwargs
        )
    other = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ eos_token }}"
    assert ours.apply_chat_template(conversation, chat_template=other, tokenize=False) == (
        "[Be brief.][Which letter? a]<|im_end|>"
    )
    rendered = ours.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(conversation, add_generation_prompt=True) == ours.encode(
        rendered, add_special_tokens=False
    )
    assert ours.encode(rendered).count(ours.bos_token_id) == 3  # one id per <|im_start|>


def test_a_template_can_refuse_a_conversation(both):
    ours, _ = both
    refusing = "{{ raise_exception('no system role here') }}"
    with pytest.raises(ValueError, match="no system role here"):
        ours.apply_chat_template([], chat_template=refusing, tokenize=False)


def test_encode_takes_one_string(both):
    ours, _ = both
    with pytest.raises(TypeError, match="encode takes one string, got list"):
        ours.encode(["ab"])


def test_the_saved_folder_is_what_transformers_saves_and_loads(both, tmp_path):
    ours, theirs = both
    written = ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(str(tmp_path / "theirs"))
    names = sorted(p.name for p in (tmp_path / "theirs").iterdir())
    assert sorted(p.split("/")[-1] for p in written) == names
    for name in names:
        a, b = ((tmp_path / side / name).read_text() for side in ("ours", "theirs"))
        assert (json.loads(a) == json.loads(b)) if name.endswith(".json") else a == b, name
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "ours"), local_files_only=True)
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text)
    conversation = [{"role": "user", "content": "ab"}]
    assert loaded.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    ) == ours.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def test_a_tiny_model_loads_without_transformers():
    code = (
        "import sys; from a3po_jax.model.loader import load_model; from a3po_jax.tasks import "
        "render_prompt; from a3po_jax.tasks.toy import LetterTask; m = load_model('tiny'); "
        "p = LetterTask().prompts('train')[0]; print(len(render_prompt(m.tokenizer, p)) > 0, "
        "'transformers' in sys.modules)"
    )
    assert run_snippet(code).split() == ["True", "False"]
