"""Checkpoints in and out, checked against transformers' PyTorch models.

Tiny random Llama / Qwen2 / Qwen3 models are built in PyTorch, saved with `save_pretrained`
and loaded through `checkpoint_io`; their logits must equal transformers' to 1e-4 on a batch
with left and right padding. A tiny GGUF is written with the `gguf` package (Q/K permuted
the llama.cpp way, one tensor Q8_0-quantised). The real SmolLM2-135M-Instruct GGUF tests
are marked slow (transformers needs ~40 s to dequantise it).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers.model_reference import greedy_generate  # noqa: E402
from helpers.python_snippet import run_snippet  # noqa: E402

from a3po_jax.model import apply, checkpoint_io, gguf_io  # noqa: E402
from a3po_jax.model.checkpoint_io import (  # noqa: E402
    CheckpointError,
    load_hf_checkpoint,
    load_hf_config,
    save_hf_checkpoint,
)
from a3po_jax.model.gguf_io import load_gguf  # noqa: E402

_SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
)

HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **_SMALL, tie_word_embeddings=False, rope_parameters={"rope_theta": 5000.0}
    ),
    "llama_tied_mha": lambda: transformers.LlamaConfig(
        **{**_SMALL, "num_key_value_heads": 4}, tie_word_embeddings=True
    ),
    # Llama 3.1 frequency scaling; original length 32 puts the 8 frequencies of head_dim 16
    # in all three regimes (kept, interpolated, slowed down).
    "llama3_rope": lambda: transformers.LlamaConfig(
        **_SMALL,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**_SMALL, tie_word_embeddings=True),
    # Qwen3: q/k norm, and head_dim 24 != hidden / heads, as in the real models
    "qwen3": lambda: transformers.Qwen3Config(**_SMALL, head_dim=24, tie_word_embeddings=False),
}
HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "llama_tied_mha": "LlamaForCausalLM",
    "llama3_rope": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _random_hf_model(name, seed=0):
    """A transformers model with *every* parameter random: with HF's init the norm weights
    are all ones and biases zero, which would hide a swapped or dropped norm/bias tensor."""
    torch.manual_seed(seed)
    config = HF_CONFIGS[name]()
    config._attn_implementation = "eager"
    model = getattr(transformers, HF_CLASSES[name])(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def _padded_batch(vocab, seed=0):
    """Row 0 right-padded (5 valid of 8), row 1 left-padded (6 valid), row 2 full.
    Returns tokens, attention mask [B, T] (1 = valid) and positions counting valid tokens."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, vocab, size=(3, 8)).astype(np.int32)
    valid = np.ones((3, 8), np.int32)
    valid[0, 5:] = 0
    valid[1, :2] = 0
    tokens[valid == 0] = 0
    positions = np.clip(np.cumsum(valid, axis=1) - 1, 0, None).astype(np.int32)
    return tokens, valid, positions


def _hf_logits(model, tokens, valid, positions):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(valid, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


def _our_logits(params, config, tokens, valid, positions):
    fwd = jax.jit(lambda p, t, s, seg: apply(p, t, s, config=config, segment_ids=seg)[0])
    return np.asarray(fwd(params, tokens, positions, valid))


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    model = _random_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return request.param, model, path


def _config_via_transformers(path):
    return checkpoint_io.config_from_hf(
        transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    )


def test_config_json_reads_as_transformers_reads_it(hf_checkpoint):
    """`load_hf_config` reads config.json as JSON: the same ModelConfig as going through
    transformers' config classes, for every architecture and rope variant."""
    _, _, path = hf_checkpoint
    assert load_hf_config(path) == _config_via_transformers(path)


_OPTIONAL_FIELDS = (
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "use_sliding_window",
)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_config_defaults_are_transformers_defaults(name, tmp_path):
    """A config.json without its optional fields: each takes the value transformers' config
    class gives it (`_HF_CONFIG_DEFAULTS` checked against the classes themselves)."""
    HF_CONFIGS[name]().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"] = [HF_CLASSES[name]]  # as `save_pretrained` of a model writes it
    for field in _OPTIONAL_FIELDS:
        raw.pop(field, None)
    raw["num_attention_heads"] = 32  # Qwen's default of 32 kv heads must divide it
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = load_hf_config(tmp_path)
    assert ours == _config_via_transformers(tmp_path)
    assert ours.n_kv_heads == 32  # Llama: the heads; Qwen: the class default
    assert ours.head_dim == (128 if name == "qwen3" else 2)  # Qwen3's default, else 64 / 32


def test_config_without_a_shape_field_is_named(llama_dir):
    raw = json.loads((llama_dir / "config.json").read_text())
    del raw["intermediate_size"]
    (llama_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="intermediate_size"):
        load_hf_config(llama_dir)


def test_logits_equal_transformers(hf_checkpoint):
    name, model, path = hf_checkpoint
    config, params = load_hf_checkpoint(path)
    expected = {"qwen2": (True, False), "qwen3": (False, True)}.get(name, (False, False))
    assert (config.qkv_bias, config.qk_norm) == expected
    tokens, valid, positions = _padded_batch(config.vocab_size)
    ours = _our_logits(params, config, tokens, valid, positions)
    ref = _hf_logits(model, tokens, valid, positions)
    mask = valid.astype(bool)
    assert np.isfinite(ours).all()  # padding queries attend nothing, still finite
    # Logits here are O(1-10); a wrong layout (Q/K head order, rope halves, GQA grouping,
    # transposed weights) gives O(1) differences, float32 reordering ~1e-6.
    assert np.abs(ours[mask] - ref[mask]).max() <= 1e-4


def test_sharded_checkpoint_equals_single_file(tmp_path):
    model = _random_hf_model("qwen2", seed=1)
    model.save_pretrained(tmp_path / "one", safe_serialization=True)
    model.save_pretrained(tmp_path / "many", safe_serialization=True, max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "many").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "many" / "model.safetensors.index.json").is_file()
    _, one = load_hf_checkpoint(tmp_path / "one")
    _, many = load_hf_checkpoint(tmp_path / "many")
    jax.tree.map(np.testing.assert_array_equal, one, many)


def test_save_roundtrip_and_transformers_reads_it(tmp_path):
    model = _random_hf_model("qwen3", seed=2)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    config, params = load_hf_checkpoint(tmp_path / "hf")

    save_hf_checkpoint(params, config, tmp_path / "ours", max_shard_bytes=30_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    config2, params2 = load_hf_checkpoint(tmp_path / "ours")
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params, params2)

    # transformers itself loads what we wrote and computes the same logits
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    tokens, valid, positions = _padded_batch(config.vocab_size, seed=3)
    np.testing.assert_array_equal(
        _hf_logits(reloaded, tokens, valid, positions), _hf_logits(model, tokens, valid, positions)
    )


def test_bfloat16_load_casts_every_parameter(tmp_path):
    _random_hf_model("llama").save_pretrained(tmp_path, safe_serialization=True)
    config, params = load_hf_checkpoint(tmp_path, param_dtype="bfloat16")
    assert config.param_dtype == config.compute_dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


# ---------------------------------------------------------------------------------------------
# Errors name what is wrong


@pytest.fixture()
def llama_dir(tmp_path):
    _random_hf_model("llama").save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unknown_architecture_is_named(llama_dir):
    _edit_config(llama_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_hf_config(llama_dir)


def test_mismatched_tensor_names_tensor_and_both_shapes(llama_dir):
    _edit_config(llama_dir, intermediate_size=72)  # checkpoint has 80
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(llama_dir)
    message = str(err.value)
    assert "mlp.gate_proj.weight" in message and "(80, 64)" in message and "(72, 64)" in message


def test_missing_and_unexpected_tensors_are_named(llama_dir):
    from safetensors.numpy import load_file, save_file

    file = llama_dir / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*32, 64"
    ):
        load_hf_checkpoint(llama_dir)

    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((80, 64), np.float32)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(llama_dir)


# ---------------------------------------------------------------------------------------------
# GGUF


def _write_gguf(model, path, quantised="ffn_up"):
    """Export a transformers Llama the way llama.cpp's converter does: Q/K rows permuted,
    one tensor kind Q8_0-quantised. Returns the model with that tensor replaced by its
    dequantised value, which is what the GGUF holds."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    gguf_names = {v: k for k, v in gguf_io._GGUF_LAYER_TO_HF.items()}
    gguf_names.update({v: k for k, v in gguf_io._GGUF_TO_HF.items()})
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for hf_name, w in state.items():
        if hf_name.startswith("model.layers."):
            _, _, i, rest = hf_name.split(".", 3)
            name = f"blk.{i}.{gguf_names[rest]}"
        else:
            name = gguf_names[hf_name]
        if rest_is(hf_name, "q_proj.weight"):
            w = gguf_io._permute_qk(w, config.num_attention_heads)
        elif rest_is(hf_name, "k_proj.weight"):
            w = gguf_io._permute_qk(w, config.num_key_value_heads)
        if quantised in name:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
            with torch.no_grad():
                model.get_parameter(hf_name).copy_(torch.from_numpy(deq))
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def rest_is(hf_name, suffix):
    return hf_name.endswith("self_attn." + suffix)


def test_gguf_unpermutes_qk_and_dequantises(tmp_path):
    model = _write_gguf(_random_hf_model("llama", seed=4), tmp_path / "tiny.gguf")
    config, params = load_gguf(tmp_path / "tiny.gguf")
    assert (config.n_layers, config.n_heads, config.n_kv_heads, config.rope_theta) == (
        2,
        4,
        2,
        5000.0,
    )
    assert not config.tie_embeddings  # the GGUF has output.weight
    tokens, valid, positions = _padded_batch(config.vocab_size, seed=5)
    ours = _our_logits(params, config, tokens, valid, positions)
    ref = _hf_logits(model, tokens, valid, positions)
    mask = valid.astype(bool)
    assert np.abs(ours[mask] - ref[mask]).max() <= 1e-4


def test_qk_permutation_roundtrip():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    permuted = gguf_io._permute_qk(w, 4)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gguf_io._unpermute_qk(permuted, 4), w)
    # llama.cpp interleaves: within each head, row 2j comes from rotary half 0, 2j+1 from half 1
    np.testing.assert_array_equal(permuted[1], w[8])


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from its GGUF (slow: transformers dequantises it in ~40 s)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1 + 1 ="]


@pytest.fixture(scope="module")
def smollm2():
    from a3po_jax.model.assets import smollm2_gguf_path

    try:
        gguf_path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    config, params = load_gguf(gguf_path)
    tokenizer = checkpoint_io.load_tokenizer(gguf_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        local_files_only=True,
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    return config, params, tokenizer, hf


@pytest.mark.e2e  # the real SmolLM2-135M checkpoint, loaded from its file
def test_smollm2_gguf_logits_equal_transformers(smollm2):
    config, params, tokenizer, hf = smollm2
    assert (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads) == (30, 576, 9, 3)
    assert config.rope_theta == 100000.0 and config.tie_embeddings
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, ids))
    tokens = np.zeros((len(ids), width), np.int32)
    valid = np.zeros((len(ids), width), np.int32)
    for row, seq in enumerate(ids):  # right padding
        tokens[row, : len(seq)] = seq
        valid[row, : len(seq)] = 1
    positions = np.clip(np.cumsum(valid, 1) - 1, 0, None).astype(np.int32)
    ours = _our_logits(params, config, tokens, valid, positions)
    ref = _hf_logits(hf, tokens, valid, positions)
    mask = valid.astype(bool)
    # 30 layers in float32: XLA's CPU matmuls round about twice as much as PyTorch's (measured
    # 8e-7 vs 5e-7 relative on 576-wide dots), so on logits of magnitude ~30 the two differ by
    # ~1.5e-4 absolute, ~5e-6 relative -- while transformers' own float32 run is 7e-5 away
    # from its float64 run. The rounding is at the scale of the row, not of the element: a
    # logit near 0 differs by as much (1.1e-4 at -0.016 on an Intel Xeon). Hence 1e-4
    # relative plus 3e-4 absolute; a wrong layer moves logits by whole units.
    np.testing.assert_allclose(ours[mask], ref[mask], rtol=1e-4, atol=3e-4)


@pytest.mark.e2e  # the real SmolLM2-135M checkpoint, loaded from its file
def test_smollm2_greedy_equals_transformers_generate(smollm2):
    config, params, tokenizer, hf = smollm2
    n_new = 8
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    # One right-padded batch: a single prefill and decode program for the three prompts.
    tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for row, seq in enumerate(ids):
        tokens[row, : len(seq)] = seq
    lengths = jnp.array([len(seq) for seq in ids], jnp.int32)
    ours = np.asarray(greedy_generate(params, config, jnp.asarray(tokens), lengths, n_new))
    for prompt, seq, row in zip(PROMPTS, ids, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([seq]), max_new_tokens=n_new, do_sample=False, eos_token_id=None
            )
        theirs = out[0, len(seq) :].tolist()
        assert row.tolist() == theirs, (prompt, tokenizer.decode(row), tokenizer.decode(theirs))
    assert PROMPTS[0] == "The capital of France is"
    assert tokenizer.decode(ours[0][:3]).startswith(" Paris.")


# ---------------------------------------------------------------------------------------------
# Loading needs no torch


_NO_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` raises; transformers sees no torch
from a3po_jax.model.checkpoint_io import load_hf_checkpoint
from a3po_jax.model.gguf_io import load_gguf
config, params = load_hf_checkpoint(sys.argv[1])
gguf_config, _ = load_gguf(sys.argv[2])
assert "torch" not in sys.modules or sys.modules["torch"] is None
print(config.n_params, gguf_config.n_params)
"""


def test_loading_works_without_torch(tmp_path):
    model = _random_hf_model("qwen2", seed=6)
    config, params = load_hf_checkpoint(_saved(model, tmp_path / "hf"))
    save_hf_checkpoint(params, config, tmp_path / "ours")
    _write_gguf(_random_hf_model("llama", seed=7), tmp_path / "tiny.gguf")
    stdout = run_snippet(_NO_TORCH, tmp_path / "ours", tmp_path / "tiny.gguf")
    assert stdout.split()[0] == str(config.n_params)


_NO_TORCH_IMPORTED = """
import sys
from a3po_jax.model.checkpoint_io import load_hf_checkpoint, load_tokenizer
config, params = load_hf_checkpoint(sys.argv[1])
tokenizer = load_tokenizer(sys.argv[1])
assert "torch" not in sys.modules, "loading imported torch"
print(config.n_params, tokenizer.encode("ab1"))
"""


_TOKENIZER_CLASS_IMPORTS_TORCH = """
import sys, transformers
transformers.PreTrainedTokenizerFast
print("torch" in sys.modules, transformers.__version__)
"""


def test_loading_a_folder_does_not_import_torch(tmp_path):
    """With torch installed, loading a checkpoint folder and its fast tokenizer leaves torch
    unimported (transformers' auto classes would import it: 0.25 GiB and seconds)."""
    from a3po_jax.model.char_tokenizer import char_tokenizer

    transformers_own = run_snippet(_TOKENIZER_CLASS_IMPORTS_TORCH).split()
    if transformers_own[0] == "True":  # e.g. 5.17: its fast-tokenizer module imports torch
        pytest.skip(f"transformers {transformers_own[1]}'s PreTrainedTokenizerFast imports torch")
    path = _saved(_random_hf_model("qwen2", seed=8), tmp_path)
    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(str(path))
    assert checkpoint_io._plain_fast_tokenizer(path)
    n_params, ids = run_snippet(_NO_TORCH_IMPORTED, path).split(maxsplit=1)
    assert n_params == str(load_hf_config(path).n_params)
    assert ids.strip() == str(tokenizer.encode("ab1"))


def test_fast_tokenizer_equals_auto_tokenizer(tmp_path):
    """The generic fast class `load_tokenizer` uses is the tokenizer AutoTokenizer builds:
    same ids, special tokens and chat template."""
    from a3po_jax.model.char_tokenizer import char_tokenizer

    char_tokenizer().save_pretrained(str(tmp_path))
    ours = checkpoint_io.load_tokenizer(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "12+7=19, ab"
    assert ours.encode(text) == auto.encode(text)
    assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (
        auto.eos_token_id,
        auto.pad_token_id,
        auto.bos_token_id,
    )
    assert ours.chat_template == auto.chat_template


def _saved(model, path):
    model.save_pretrained(path, safe_serialization=True)
    return path


# ---------------------------------------------------------------------------------------------
# SmolLM2 assets


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    from a3po_jax.model import assets

    monkeypatch.setenv("A3PO_CACHE", str(tmp_path))
    assert assets.smollm2_cache_dir() == tmp_path / "smollm2-135m-instruct"
    assert not assets.is_prepared()


def test_smollm2_config_matches_the_gguf_metadata():
    import gguf

    from a3po_jax.model import assets

    try:
        path = assets.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert gguf_io.gguf_config(gguf.GGUFReader(str(path))) == assets.smollm2_config()


@pytest.mark.e2e  # the real SmolLM2-135M checkpoint, loaded from its file
def test_prepare_smollm2_once_then_load_and_generate(tmp_path):
    from a3po_jax.model import assets

    try:
        assets.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    folder = assets.prepare_smollm2(tmp_path / "smol")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert assets.prepare_smollm2(folder) == folder  # second call: nothing rewritten
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp

    config, params, tokenizer = assets.load_smollm2(cache_dir=folder)
    assert config == assets.smollm2_config()
    assert tokenizer.eos_token_id == 2 and tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    ids = tokenizer("The capital of France is")["input_ids"]
    out = greedy_generate(params, config, jnp.array([ids]), jnp.array([len(ids)]), 3)
    assert tokenizer.decode(out[0]).startswith(" Paris.")
