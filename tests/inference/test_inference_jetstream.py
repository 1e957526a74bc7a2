"""`JetStreamEngine` served by JetStream's own orchestrator and gRPC server.

JetStream runs in a child process: its threads SIGKILL the whole process on any error (which
must not take pytest down), it imports TensorFlow, and it sends DEBUG logs to stdout. The
child serves the tiny model greedily through `orchestrator.Driver` + `LLMOrchestrator` and
through `server_lib.run` + JetStream's gRPC client stub, and prints the token ids; the test
compares them with a full recomputation of `[BOS] + prompt` (the orchestrator prepends BOS).
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
MARKER = "JETSTREAM_RESULT "
BOS, EOS, PAD = 1, 2, 0
PROMPTS = [[5, 6, 7], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [40, 41, 42, 43, 44]]
MAX_TOKENS = 12

pytestmark = pytest.mark.e2e  # JetStream's own orchestrator, in a child process
# Skip where the extra is absent; find_spec, not an import: only the child imports JetStream.
if importlib.util.find_spec("jetstream") is None:
    pytest.skip(
        "needs the jetstream extra: pip install 'a3po_jax[jetstream]'", allow_module_level=True
    )


def _child() -> None:
    import asyncio

    import grpc
    import jax

    sys.path.insert(0, TESTS)
    from helpers.inference_reference import CFG, scaled_params
    from jetstream.core import config_lib, orchestrator, server_lib
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

    from a3po_jax.inference.engine.jetstream_engine import JetStreamEngine  # sets jax.tree_map

    engine = JetStreamEngine(
        CFG, scaled_params(0), num_slots=4, max_prefill_length=16, max_cache_len=64,
        bos_id=BOS, eos_id=EOS, pad_id=PAD,
    )  # fmt: skip

    def request(prompt):
        return jetstream_pb2.DecodeRequest(
            token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt),
            max_tokens=MAX_TOKENS,
        )

    # 1. The orchestrator's Driver with its Decode coroutine called directly.
    params = engine.load_params()
    driver = orchestrator.Driver(
        prefill_engines=[engine], generate_engines=[engine],
        prefill_params=[params], generate_params=[params], interleaved_mode=True,
    )  # fmt: skip
    llm = orchestrator.LLMOrchestrator(driver=driver)

    async def decode(prompt):
        out = []
        async for response in llm.Decode(request(prompt)):
            out.extend(response.stream_content.samples[0].token_ids)
        return out

    async def decode_all():
        return await asyncio.gather(*(decode(p) for p in PROMPTS))

    # The loop stays open until the driver's threads have stopped: the detokenize thread
    # closes a finished request's channel through it (call_soon_threadsafe), sometimes after
    # the last token has reached the caller. With asyncio.run the loop was already closed
    # then, the thread raised "Event loop is closed" and JetStream SIGKILLed the child.
    loop = asyncio.new_event_loop()
    try:
        via_driver = loop.run_until_complete(decode_all())
    finally:
        driver.stop()
        loop.close()

    # 2. JetStream's gRPC server (server_lib.run) and its client stub.
    class Config(config_lib.ServerConfig):
        interleaved_slices = ("cpu=1",)
        interleaved_engine_create_fns = (lambda devices: engine,)

    import portpicker

    port = portpicker.pick_unused_port()
    server = server_lib.run(port=port, config=Config, devices=jax.devices()[:1], threads=8)
    with grpc.insecure_channel(f"localhost:{port}") as channel:
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        via_server = []
        for p in PROMPTS:
            tokens = []
            for response in stub.Decode(request(p)):
                tokens.extend(response.stream_content.samples[0].token_ids)
            via_server.append(tokens)
    server.stop()
    print(MARKER + json.dumps({"driver": via_driver, "server": via_server}), flush=True)


def _expected(params, prompt):
    from helpers.inference_reference import recompute_greedy

    ref = recompute_greedy(params, [BOS, *prompt], MAX_TOKENS)
    # JetStream ends a sequence at a stop token (EOS or pad) without emitting it.
    for i, t in enumerate(ref):
        if t in (EOS, PAD):
            return ref[:i]
    return ref


def test_jetstream_orchestrator_greedy_equals_recomputation():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, (
        f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
    )
    got = json.loads(lines[-1][len(MARKER) :])

    from helpers.inference_reference import scaled_params

    params = scaled_params(0)
    for i, prompt in enumerate(PROMPTS):
        expected = _expected(params, prompt)
        assert len(expected) >= 4, "reference stops too early to prove much"
        np.testing.assert_array_equal(got["driver"][i], expected, err_msg=f"driver {prompt}")
        np.testing.assert_array_equal(got["server"][i], expected, err_msg=f"server {prompt}")


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
