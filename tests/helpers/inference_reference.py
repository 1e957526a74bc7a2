"""Reference decoding for the inference tests: the tiny model run without a KV cache.

References are full recomputations (`model.apply` over the whole sequence), so an error in
prefill padding, cache writes, positions or slot bookkeeping shows up as a different token
or log-prob. Not a test module (no `test_` prefix): the inference test files import it.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax import model as M
from a3po_jax.core import losses

CFG = M.ModelConfig.tiny()
REF_LEN = 160  # fixed reference length: one compile for every recomputation


def scaled_params(key: int, scale: float = 8.0):
    """Random tiny-model params with 8x the default init scale.

    The default init (std 0.02) is so flat that greedy decoding repeats the last prompt
    token forever, which would hide cache and position bugs; std 0.16 gives varied tokens.
    """
    params = M.init_params(CFG, jax.random.key(key))
    return jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, params)


@jax.jit
def _full_logits(params, tokens):  # tokens [1, REF_LEN] -> [REF_LEN, V], no KV cache
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, _ = M.apply(params, tokens, positions, config=CFG)
    return logits[0]


def logits_of(params, seq) -> jax.Array:
    # Right-padding does not change causal logits at the real positions.
    padded = np.zeros((1, REF_LEN), np.int32)
    padded[0, : len(seq)] = seq
    return _full_logits(params, jnp.asarray(padded))


def recompute_greedy(params, prompt, n) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(jnp.argmax(logits_of(params, seq)[len(seq) - 1])))
    return seq[len(prompt) :]


def recompute_logprobs(params, prompt, tokens, temperature) -> np.ndarray:
    """The trainer's view: token_logprobs(apply(params, prompt + tokens) / T, tokens)."""
    seq = list(prompt) + list(tokens)
    P, R = len(prompt), len(tokens)
    logits = logits_of(params, seq)[P - 1 : P - 1 + R]  # [R, V]
    scale = temperature if temperature > 0 else 1.0
    return np.asarray(losses.token_logprobs((logits / scale)[None], jnp.asarray([tokens]))[0])


def collect(host, n, timeout=120.0) -> dict:
    """Polls a host (or client) until n results are out: {(request_id, index): result}."""
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"timed out with {len(out)} of {n} results"
        for r in host.poll(timeout=1.0):
            out[(r.request_id, r.sample_index)] = r
    return out


# ---------------------------------------------------------------------------------------------
# A gRPC inference host in a subprocess (for the gRPC, trainer-over-gRPC and fuzz tests).


def start_grpc_server(token_file, *args):
    """Start `python -m a3po_jax.cli.serve --model tiny` on a free port.

    Returns (process, "host:port"); the server writes its token to `token_file`. Extra
    command-line flags go in `args`. Fails the test if the server is not ready in 180 s.
    """
    import os
    import subprocess
    import sys
    import tempfile
    import threading
    from pathlib import Path

    import pytest

    from a3po_jax.inference.remote.grpc_messages import TOKEN_ENV
    from a3po_jax.inference.remote.grpc_server import READY_LINE

    cmd = [
        sys.executable, "-m", "a3po_jax.cli.serve", "--model", "tiny",
        "--port", "0", "--host", "127.0.0.1", "--token-file", str(token_file), *args,
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop(TOKEN_ENV, None)
    # The server's stderr is kept for stop_grpc_server, which shows it when a stop hangs.
    folder = Path(token_file).parent
    fd, name = tempfile.mkstemp(prefix="grpc-server-", suffix=".stderr", dir=folder)
    stderr_path = Path(name)
    with os.fdopen(fd, "w") as stderr:
        proc = subprocess.Popen(
            cmd,
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    proc.stderr_path = stderr_path
    address = []

    def read_ready():
        for line in proc.stdout:
            if line.startswith(READY_LINE):
                address.append(line.split()[1])
                return

    reader = threading.Thread(target=read_ready, daemon=True)
    reader.start()
    reader.join(timeout=180)
    if not address:
        proc.kill()
        pytest.fail("gRPC server did not report ready within 180 s")
    return proc, address[0]


def stop_grpc_server(proc, timeout_s: float = 30.0) -> None:
    """SIGTERM (the server's documented clean stop; SIGINT is ignored in a process started
    from a background shell), then SIGKILL after `timeout_s`: a server that needed the kill
    has printed every thread's stack first (SIGUSR1), and the test fails showing them."""
    import signal
    import subprocess

    import pytest

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
        return
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        proc.kill()
        proc.wait()
    stacks = proc.stderr_path.read_text(errors="replace")[-6000:]
    pytest.fail(f"the gRPC server did not stop within {timeout_s:g} s of SIGTERM:\n{stacks}")
