"""One model loader: the trainer, the evaluation CLI and the gRPC server build the same model
for the same name (they used to disagree: tiny's max_seq_len, no GGUF or dtypes in the
server)."""

import jax
import numpy as np
import pytest

from a3po_jax.inference.remote import grpc_server
from a3po_jax.model import ModelConfig, checkpoint_io, init_params
from a3po_jax.model.char_tokenizer import char_tokenizer
from a3po_jax.model.loader import TINY_MAX_SEQ_LEN, LoadedModel, load_model
from a3po_jax.training.config import ModelSection
from a3po_jax.training.trainer import Policy, load_policy

NUMERICS = dict(param_dtype="bfloat16", compute_dtype="bfloat16")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen2-style checkpoint folder (untied head, q/k/v bias) with its tokenizer."""
    config = ModelConfig.tiny(qkv_bias=True, tie_embeddings=False, max_seq_len=512)
    path = tmp_path_factory.mktemp("hf")
    checkpoint_io.save_hf_checkpoint(init_params(config, jax.random.key(5)), config, path)
    char_tokenizer().save_pretrained(str(path))
    return path


def _three_paths(name):
    """(trainer, gRPC server, loader) for one name: `a3po-train` goes through `load_policy`,
    `cli.serve` through `grpc_server.load_model`, and `cli.evaluate` calls `load_model` with
    the run's model section directly."""
    policy = load_policy(ModelSection(name=str(name), seed=3, **NUMERICS))
    server_config, server_params = grpc_server.load_model(str(name), init_seed=3, **NUMERICS)
    loaded = load_model(str(name), seed=3, **NUMERICS)
    return policy, (server_config, server_params), loaded


@pytest.mark.parametrize("which", ["tiny", "hf_dir"])
def test_trainer_server_and_loader_build_the_same_model(which, request):
    name = "tiny" if which == "tiny" else request.getfixturevalue("hf_dir")
    policy, (server_config, server_params), loaded = _three_paths(name)
    assert isinstance(policy, LoadedModel) and Policy is LoadedModel
    assert policy.config == server_config == loaded.config
    assert loaded.config.param_dtype == "bfloat16" == loaded.config.compute_dtype
    if which == "tiny":
        # The server's tiny was max_seq_len 256 and the trainer's 1024: one length now.
        assert loaded.config.max_seq_len == TINY_MAX_SEQ_LEN
    else:
        assert loaded.config.qkv_bias and not loaded.config.tie_embeddings
        assert loaded.config.max_seq_len == 512  # from the checkpoint, not a default
    for a, b in zip(jax.tree.leaves(policy.params), jax.tree.leaves(server_params), strict=True):
        assert a.dtype == b.dtype == np.dtype("bfloat16")
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert loaded.tokenizer.encode("ab1") == char_tokenizer().encode("ab1")


def test_tiny_seed_changes_the_weights():
    a, b = load_model("tiny", seed=0), load_model("tiny", seed=1)
    assert not np.array_equal(a.params["embed"]["embedding"], b.params["embed"]["embedding"])


@pytest.mark.parametrize("bad", ["/no/such/checkpoint", "not-a-model", "{tmp}"])
def test_a_bad_name_is_one_error_naming_model_name(bad, tmp_path):
    bad = bad.format(tmp=tmp_path)  # an existing directory without config.json
    with pytest.raises(FileNotFoundError, match=r"model\.name=.*'tiny', 'smollm2'"):
        load_model(bad)
    with pytest.raises(FileNotFoundError, match=r"model\.name="):
        grpc_server.load_model(bad)
