"""An inference host in a child process on this machine, on cores of its own.

Inference layer (remote).

    host = LocalHostProcess(model="smollm2", cores=[0], update_policy="drain").start()
    client = GrpcInferenceClient(host.address, host.token)      # as for any remote host
    ...
    host.close()

The child is `python -m a3po_jax.cli.serve` on a free loopback port, with a fresh random
token that only this process and the child know (a file readable by its owner only, in a
private directory). It pins itself to `cores` before JAX starts (so XLA sizes its thread
pool to them), and it ends with its parent on every path: `close`, the parent's exit, and
the parent being killed with SIGKILL (``--exit-with-parent``: Linux's parent-death signal,
and a watch of the parent's pid where that signal does not exist).

Nothing is left behind however the parent ends: once the child serves it has read its token
and both ends hold its stderr file open, so the whole private directory is removed then
(the log is read through the descriptor this process keeps: `log_tail`). A directory left
by a parent killed while its child was still starting is named after the parent's pid, and
the next start removes those of parents that no longer run (`remove_stale_folders`).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from a3po_jax.inference.remote.grpc_server import READY_LINE
from a3po_jax.inference.types import InferenceError

log = logging.getLogger(__name__)

# The private directory of a local host: this prefix, the parent's pid, a dash, random.
FOLDER_PREFIX = "a3po-host-"


def remove_stale_folders(parent: str | os.PathLike | None = None) -> list[Path]:
    """Removes the private directories (in `parent`, default the temporary directory) of
    local hosts whose starting process no longer runs and which this user owns: what a
    parent killed with SIGKILL left (its ``host.log``; the token was already gone). Returns
    the directories removed."""
    removed = []
    root = Path(parent if parent is not None else tempfile.gettempdir())
    try:
        candidates = list(root.glob(f"{FOLDER_PREFIX}*-*"))
    except OSError:
        return removed
    for folder in candidates:
        pid = folder.name[len(FOLDER_PREFIX) :].split("-", 1)[0]
        try:
            if not pid.isdigit() or folder.lstat().st_uid != os.getuid():
                continue
            if _running(int(pid)) or not folder.is_dir():
                continue
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


class LocalHostProcess:
    """A `cli.serve` child process pinned to `cores`.

    Args:
      model: what the host loads (`model.loader.load_model`'s names: "tiny", "smollm2", a
        checkpoint directory or a .gguf file).
      cores: CPU ids the child may run on.
      update_policy: the host's weight-update policy ("in_flight" or "drain").
      param_dtype / compute_dtype: the serving dtypes.
      init_seed: the params seed of ``model="tiny"``.
      num_slots, prefill_buckets, max_cache_len, batch_invariant: the host's engine
        (`InferenceHost`).
      start_timeout_s: seconds allowed until the child serves (it loads and compiles).
      compile_cache_dir: the child's JAX persistent compilation cache (the run's
        ``system.run.compile_cache_dir``; "" = none, unless this process's environment
        names one, which the child inherits).
    """

    def __init__(
        self,
        *,
        model: str,
        cores: Sequence[int],
        update_policy: str,
        param_dtype: str = "float32",
        compute_dtype: str = "float32",
        init_seed: int = 0,
        num_slots: int = 8,
        prefill_buckets: Sequence[int] = (32, 64, 128, 256),
        max_cache_len: int | None = None,
        batch_invariant: bool = False,
        start_timeout_s: float = 600.0,
        compile_cache_dir: str = "",
    ):
        if not cores:
            raise ValueError("cores must name at least one CPU")
        self.cores = sorted(int(c) for c in cores)
        self._args = [
            "--model", model,
            "--update-policy", update_policy,
            "--param-dtype", param_dtype,
            "--compute-dtype", compute_dtype,
            "--init-seed", str(init_seed),
            "--num-slots", str(num_slots),
            "--prefill-buckets", ",".join(str(int(b)) for b in prefill_buckets),
            "--compile-cache-dir", compile_cache_dir,
        ]  # fmt: skip
        if max_cache_len is not None:
            self._args += ["--max-cache-len", str(max_cache_len)]
        if batch_invariant:
            self._args.append("--batch-invariant")
        self.start_timeout_s = start_timeout_s
        self.token = secrets.token_urlsafe(32)
        self.address: str | None = None
        self.proc: subprocess.Popen | None = None
        self._dir: Path | None = None
        self._log: int | None = None  # a read descriptor of the child's stderr file

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def log_path(self) -> Path | None:
        """The child's stderr file while the child starts; None once it serves (the file is
        unlinked then and read through a descriptor held open: `log_tail`)."""
        return None if self._dir is None else self._dir / "host.log"

    def start(self) -> LocalHostProcess:
        """Starts the child and waits until it serves; InferenceError (with the end of its
        log) if it exits or does not serve within `start_timeout_s`."""
        if self.proc is not None:
            raise RuntimeError("LocalHostProcess.start() called twice")
        for stale in remove_stale_folders():
            log.info("removed %s, left by a local host's parent that was killed", stale)
        # Mode 0700; the pid in the name lets a later start find it if this process is killed.
        self._dir = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
        token_file = self._dir / "token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        cmd = [
            sys.executable, "-m", "a3po_jax.cli.serve", *self._args,
            "--host", "127.0.0.1", "--port", "0", "--token-file", str(token_file),
            "--exit-with-parent", str(os.getpid()),
            "--cores", ",".join(str(c) for c in self.cores),
        ]  # fmt: skip
        env = dict(os.environ)
        env.pop("A3PO_HOST_TOKEN", None)  # the token file decides
        self._log = os.open(self.log_path, os.O_RDONLY | os.O_CREAT, 0o600)
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                env=env,
                start_new_session=True,  # a Ctrl-C to the trainer's terminal is the trainer's
            )
        ready: list[str] = []

        def read_stdout() -> None:  # the ready line, then drain (the child must never block)
            for line in self.proc.stdout:
                if not ready and line.startswith(READY_LINE):
                    ready.append(line.split()[1])

        reader = threading.Thread(target=read_stdout, name="local-host-stdout", daemon=True)
        reader.start()
        deadline = self.start_timeout_s
        while not ready and self.proc.poll() is None and deadline > 0:
            reader.join(timeout=0.2)
            deadline -= 0.2
        if not ready:
            tail = self.log_tail()
            self.close()
            raise InferenceError(
                "the local inference host did not start"
                + (" (timed out)" if deadline <= 0 else "")
                + f"; the end of its log:\n{tail}"
            )
        self.address = ready[0]
        # The child read its token before it served, and both ends hold the log open: the
        # folder goes now, so a SIGKILL of this process from here on leaves nothing behind.
        self._remove_folder()
        log.info("local inference host pid %d on %s, cores %s", self.pid, self.address, self.cores)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20, max_bytes: int = 1 << 16) -> str:
        """The last ``lines`` lines of the child's stderr (read through the held descriptor)."""
        if self._log is None:
            return ""
        try:
            size = os.fstat(self._log).st_size
            text = os.pread(self._log, max_bytes, max(0, size - max_bytes))
        except OSError:
            return ""
        return "\n".join(text.decode(errors="replace").splitlines()[-lines:])

    def _remove_folder(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def close(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` s; removes what is left of its folder."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._remove_folder()
        if self._log is not None:
            os.close(self._log)
            self._log = None

    def __enter__(self) -> LocalHostProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()
