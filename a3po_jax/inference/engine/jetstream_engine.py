"""`JetStreamEngine`: the a3po_jax engine behind JetStream's `Engine` API.

Inference layer (engine).

A thin adapter over `engine_core`, so the same model serves under JetStream's stock
orchestrator and gRPC server (`jetstream.core.orchestrator.Driver`, `server_lib.run`):

    engine = JetStreamEngine(config, params, num_slots=8, max_prefill_length=256)
    driver = orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                                 prefill_params=[engine.load_params()],
                                 generate_params=[engine.load_params()], interleaved_mode=True)

Importing this module imports JetStream, hence seqio and TensorFlow (seconds), which only
the `jetstream` extra installs: nothing else in a3po_jax imports it. It sets
`jax.tree_map = jax.tree.map` if missing, which JetStream 0.2.2's threads still call.

Differences from the in-process host, all from JetStream's API: sampling settings are fixed
per engine (`SlotSampling`, greedy by default), JetStream's stream carries token ids only
(no log-probs or versions: use `InferenceHost` / the gRPC host for RL rollouts), and the
orchestrator stops on the tokenizer's stop tokens (EOS and pad), not emitting them.

`generate` emits each slot's *pending* token (sampled at the previous step, or at insert for
the first one) and then computes the next: JetStream 0.2.2 drops whatever `prefill` would
sample, so emitting with a lag of one is how the first token reaches the client.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

if not hasattr(jax, "tree_map"):  # removed from JAX; JetStream 0.2.2 still calls it
    jax.tree_map = jax.tree.map

try:  # the `jetstream` extra (google-jetstream, with seqio and TensorFlow)
    from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2
except ImportError as err:
    raise ImportError(
        "a3po_jax.inference.engine.jetstream_engine needs JetStream: "
        "pip install 'a3po_jax[jetstream]'"
    ) from err

from a3po_jax import model as model_lib  # noqa: E402
from a3po_jax.inference.engine import engine_core, steps  # noqa: E402

# JetStream's pad_tokens only accepts a max_prefill_length from its own bucket list.
_JETSTREAM_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class TokenIdTokenizer(tokenizer_api.Tokenizer):
    """JetStream tokenizer over token ids, optionally wrapping a `tokenizers.Tokenizer`.

    With token-id requests (client-side tokenization) only `bos_id`, `pad_id` and
    `stop_tokens` matter; text requests need `hf_tokenizer`.
    """

    def __init__(self, *, bos_id: int, eos_id: int, pad_id: int = 0, hf_tokenizer=None):
        self._bos, self._eos, self._pad = bos_id, eos_id, pad_id
        self._hf = hf_tokenizer

    def encode(self, s: str, **kwargs):
        if self._hf is None:
            raise ValueError("text requests need an hf_tokenizer; send token ids instead")
        ids = np.asarray(self._hf.encode(s, add_special_tokens=False).ids, np.int32)
        return token_utils.pad_tokens(
            ids,
            self._bos,
            self._pad,
            is_bos=kwargs.get("is_bos", True),
            prefill_lengths=kwargs.get("prefill_lengths"),
            max_prefill_length=kwargs.get("max_prefill_length"),
            jax_padding=kwargs.get("jax_padding", True),
        )

    def decode(self, token_ids: list[int], **kwargs) -> str:
        if self._hf is None:
            return " ".join(str(t) for t in token_ids)
        return self._hf.decode(list(token_ids))

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int:
        return self._bos


class JetStreamEngine(engine_api.Engine):
    """JetStream `Engine` over `EngineCore` (one device, one sample per slot).

    Args:
      config, params: the model.
      num_slots: concurrent decodes (JetStream's `max_concurrent_decodes`).
      max_prefill_length: longest (padded) prompt; one of JetStream's buckets (16, 32, ...).
      max_cache_len: KV positions per slot; default min(max_prefill_length + 512,
        config.max_seq_len). A slot whose cache is full reports an invalid token (ends).
      sampling: temperature / top-k / top-p / seed for every request (default greedy).
      bos_id, eos_id, pad_id: token ids for JetStream's tokenizer (it prepends BOS to every
        prompt and stops at EOS or pad).
      hf_tokenizer: optional `tokenizers.Tokenizer` for text requests.
    """

    def __init__(
        self,
        config: model_lib.ModelConfig,
        params: Any,
        *,
        num_slots: int = 8,
        max_prefill_length: int = 256,
        max_cache_len: int | None = None,
        sampling: steps.SlotSampling | None = None,
        bos_id: int = 1,
        eos_id: int = 2,
        pad_id: int = 0,
        hf_tokenizer=None,
    ):
        if max_prefill_length not in _JETSTREAM_BUCKETS:
            raise ValueError(
                f"max_prefill_length must be one of JetStream's buckets {_JETSTREAM_BUCKETS}, "
                f"got {max_prefill_length}"
            )
        if max_cache_len is None:
            max_cache_len = min(max_prefill_length + 512, config.max_seq_len)
        buckets = tuple(b for b in _JETSTREAM_BUCKETS if b <= max_prefill_length)
        self._core = engine_core.EngineCore(
            config, num_slots=num_slots, capacity=max_cache_len, prefill_buckets=buckets
        )
        self._device = jax.devices()[0]
        # The weights as the engine serves them: split per layer, the one copy that prefill
        # and the decode step both run on (what `load_params` hands JetStream).
        self._params = self._core.split_params(jax.device_put(params, self._device))
        self._sampling = sampling or steps.SlotSampling()  # greedy
        self._tokenizer = TokenIdTokenizer(
            bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, hf_tokenizer=hf_tokenizer
        )
        # Each insert is a new sample: distinct sample indices give distinct PRNG streams.
        self._sample_counter = itertools.count()
        self._counter_lock = threading.Lock()
        self._emit = jax.jit(_emit_pending, static_argnames=("capacity",))

    # ---------------------------------------------------------------- weights and state

    def load_params(self, *args, **kwargs) -> Any:
        return self._params

    def init_decode_state(self, *args, **kwargs) -> steps.DecodeState:
        return self._core.init_decode_state()

    # ---------------------------------------------------------------- the three steps

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: steps.Prefix | None = None,
        padded_tokens: jax.Array,
        true_length: int,
    ) -> steps.Prefix:
        if existing_prefix is not None:
            raise NotImplementedError("prefix caching (existing_prefix) is not supported")
        tokens = jnp.asarray(padded_tokens, jnp.int32)  # [Tb], JetStream's bucket
        return self._core.prefill_padded(params, tokens, int(true_length))

    def insert(
        self, prefix: steps.Prefix, decode_state: steps.DecodeState, slot: int
    ) -> steps.DecodeState:
        with self._counter_lock:
            index = next(self._sample_counter)
        s = self._sampling
        coords = steps.SlotSampling(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=s.seed,
            sample_index=index % (2**31),
        )
        state, _, _ = self._core.insert(prefix, decode_state, int(slot), coords)
        return state

    def generate(
        self, params: Any, decode_state: steps.DecodeState
    ) -> tuple[steps.DecodeState, engine_api.ResultTokens]:
        data = self._emit(decode_state, capacity=self._core.capacity)  # [N, 3]
        decode_state, _, _ = self._core.generate(params, decode_state)
        result = engine_api.ResultTokens(
            data=data,
            tokens_idx=(0, 1),
            valid_idx=(1, 2),
            length_idx=(2, 3),
            samples_per_slot=1,
        )
        return decode_state, result

    # ---------------------------------------------------------------- JetStream plumbing

    def get_prefix_destination_sharding(self) -> Any:
        return jax.sharding.SingleDeviceSharding(self._device)

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="a3po_jax:token-ids")

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenIdTokenizer:
        return self._tokenizer

    @property
    def max_concurrent_decodes(self) -> int:
        return self._core.num_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._core.max_prompt_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return jax.sharding.Mesh(np.array([self._device]), ("data",))

    @property
    def colocated_cpus(self) -> None:
        return None


def _emit_pending(state: steps.DecodeState, *, capacity: int) -> jax.Array:
    """[N, 3] int32 rows (token, valid, length) of each slot's pending token.

    `length` counts the tokens emitted so far including this one (JetStream ends a slot
    when it exceeds the request's max_tokens). A slot whose cache is full cannot take its
    pending token, so it is reported invalid, which ends the sequence.
    """
    valid = state.active & (state.cache.lengths < capacity)  # [N]
    return jnp.stack([state.tokens, valid.astype(jnp.int32), state.step.astype(jnp.int32)], axis=-1)
