"""Command line: ``a3po-train EXPERIMENT.py [section.field=value ...] [--resume]``, or
``a3po-train --replay RUN_DIR [section.field=value ...]``.

CLI layer (entry points): nothing in the package imports it.

Examples::

    a3po-train experiments/quickstart_a3po.py
    a3po-train experiments/quickstart_a3po.py algo.prox=recompute steps=10 run_dir=runs/rc
    a3po-train experiments/quickstart_a3po.py --resume          # continue from checkpoints
    a3po-train --print-config experiments/quickstart_a3po.py    # show the resolved config
    a3po-train --replay runs/rec                 # re-train a system.run.record_rollouts=true run

``--replay RUN_DIR`` rebuilds the trainer from ``RUN_DIR/config.json`` (overrides apply
on top), trains on the groups recorded in ``RUN_DIR/rollouts/`` with no inference host,
into ``RUN_DIR/replay`` (``run_dir=`` to change), for the recorded steps (or ``steps=`` if
fewer), then prints whether ``loss/total`` and ``optim/grad_norm`` match the recording's
``metrics.jsonl`` per step (``replay_check.json`` in the replay's run dir).

With ``system.placement.inference_hosts`` empty the inference host is embedded in this process;
otherwise the trainer talks to the gRPC hosts at those addresses (see
``python -m a3po_jax.cli.serve``).

At the end the run's report is printed (held-out accuracy at step 0 and at the end with
95 % intervals, training reward first vs last steps, steps, wall time, peak memory,
staleness, dropped and re-issued groups) and written to ``RUN_DIR/report.md`` with its
plots (:mod:`a3po_jax.analysis.run_report`; ``python -m a3po_jax.cli.results RUN_DIR``
makes it again). ``A3PO_REPORT_PLOTS=0`` in the environment writes it without the plots
(matplotlib's import and four figures: docs/development.md, "Measured").

Exit codes: 0 when the run finished (or stopped on SIGTERM / SIGINT after saving what it
could); 1 when a write failed (disk full, read-only, a file size limit), with one line
naming the file and the checkpoint ``--resume`` continues from; 2 when it was refused, with
one line on stderr saying why (a config error, a broken experiment file, a model, task or
run dir that cannot be used, a run dir with checkpoints and no ``--resume``); 130 / 143
when a signal ended it at once (a second SIGINT / SIGTERM, one before training started, or
a run not stopped within ``STOP_DEADLINE_S`` of the first). A refused run writes nothing:
every check runs before the start-up line, and the run dir is made only once the run is
accepted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path

from a3po_jax.training.config import ConfigError, TrainConfig, apply_overrides, load_experiment

log = logging.getLogger(__name__)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class Refused(Exception):
    """The run is not started: one line on stderr (``a3po-train: <message>``), exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, like every other refusal (argparse's default adds the usage block).
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _Parser(
        prog="a3po-train", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("experiment", nargs="?", help="experiment file with a config() function")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--replay",
        metavar="RUN_DIR",
        help="re-train on the rollouts a system.run.record_rollouts=true run recorded (no host)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS, help="logging level"
    )
    # Intermixed: flags may come before, between or after the key=value overrides.
    args = parser.parse_intermixed_args(argv)
    if args.replay is not None and args.experiment is not None:
        if "=" not in args.experiment:  # --replay takes a run dir, not an experiment file
            parser.error(f"--replay RUN_DIR takes no experiment file (got {args.experiment!r})")
        args.overrides = [args.experiment, *args.overrides]
        args.experiment = None
    if args.replay is None and args.experiment is None:
        parser.error("the following arguments are required: experiment")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run ``a3po-train``; returns the exit code (2 for a run that was refused)."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = StopSignals()
    try:
        return _train(args, stop)
    except Refused as err:
        # The traceback of what was refused, for --log-level DEBUG.
        log.debug("refused", exc_info=err.__cause__ or err)
        print(f"a3po-train: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        failed = write_failure(err)
        if failed is None:
            raise
        log.debug("write failed", exc_info=err)
        print(
            f"a3po-train: stopped: cannot write {failed.filename}: "
            f"{failed.strerror or failed}; {stop.describe()}",
            file=sys.stderr,
        )
        if argv is None:  # the program itself, not a caller in Python
            # orbax's writer threads, left mid-save, print tracebacks while the interpreter
            # shuts down: end the process without them.
            stop.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return 1
    finally:
        stop.close()


class StopSignals:
    """SIGTERM and SIGINT around the trainer, for a process ``a3po-train`` owns.

    Before the trainer takes the signals over (config checks, model load, building the
    step) and after it gives them back, a stop signal ends the process at once, with a
    line saying what it leaves (:meth:`describe`). Once a stop was asked for, the process
    ends within ``stopping.STOP_DEADLINE_S`` wherever it is
    (:func:`a3po_jax.training.stopping.arm_stop_deadline`). Only from the main thread (a
    Python rule for signal handlers); elsewhere nothing is installed.
    """

    def __init__(self):
        from a3po_jax.training import stopping

        self.run_dir: str | None = None  # known once the config is
        self.phase = "before the run started"
        self._flag = self._disarm = None
        if threading.current_thread() is threading.main_thread():
            self._flag = stopping.install_sigterm_handler(
                self._stop_now, signals=stopping.STOP_SIGNALS
            )
            self._disarm = stopping.arm_stop_deadline(self.describe)

    def _stop_now(self, signum: int) -> None:
        from a3po_jax.training.stopping import exit_now, signal_name

        exit_now(signum, f"{signal_name(signum)} {self.phase}: stopping now; {self.describe()}")

    def describe(self) -> str:
        """Which checkpoint ``--resume`` would continue from, or that there is none."""
        step = latest_checkpoint_step(self.run_dir) if self.run_dir else 0
        if step:
            return f"the newest complete checkpoint is step {step} (--resume continues from it)"
        return "no checkpoint could be made (the run has no complete one to resume from)"

    def close(self) -> None:
        if self._flag is not None:
            self._flag.uninstall()
            self._disarm()
            self._flag = None


def write_failure(err: BaseException) -> OSError | None:
    """The failed write of a file behind ``err`` (an ``OSError`` naming its file, found
    along the exception's causes), or None for any other error."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.filename:
            return err
        err = err.__cause__ or err.__context__
    return None


def _train(args: argparse.Namespace, stop: StopSignals) -> int:
    cfg = resolve_config(args)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    report_plots()  # a bad A3PO_REPORT_PLOTS is refused now, not after the training
    # Before anything is loaded or written: a fresh run must not land on a finished one.
    check_run_dir_creatable(cfg.run_dir)
    start = check_run_dir(cfg, resume=args.resume)
    if cfg.system.placement.inference_cores:
        # Split cores: this process on its share before JAX starts (XLA sizes its thread
        # pool from it); the trainer starts the host process on the others.
        from a3po_jax.training import host_placement

        try:
            host_placement.pin_trainer(cfg.system.placement.inference_cores)
        except ValueError as err:
            raise Refused(f"config error: {err}") from err
    task = preflight(cfg, replay=args.replay is not None)
    setup = join_job()
    check_placement(cfg)
    # The run is accepted: its run dir is the first thing written (and taken back, if
    # empty, should the run still be refused before it trains).
    created = make_run_dir(cfg.run_dir)
    stop.run_dir, stop.phase = cfg.run_dir, "before training started"
    try:
        return _start(args, cfg, start, task, stop, setup)
    except Refused:
        remove_empty_dirs(created)
        raise


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """The run's config: the experiment file (or the replayed run's config.json) with the
    overrides applied, validated (:class:`Refused` naming the field otherwise)."""
    try:
        if args.replay is not None:
            from a3po_jax.training.recording import ReplayError, replay_config

            try:
                return replay_config(args.replay, args.overrides)
            except ReplayError as err:
                raise Refused(f"--replay: {err}") from err
        return apply_overrides(load_experiment(args.experiment), args.overrides)
    except ConfigError as err:
        raise Refused(f"config error: {err}") from err


def validate(experiment: str, overrides: list[str], *, resume: bool = False) -> TrainConfig:
    """Everything ``a3po-train EXPERIMENT OVERRIDES`` checks before it starts, without
    starting: the config (fields, combinations), the run dir (no checkpoints unless
    ``resume``; made and removed again, so that a path no check foresees, such as one
    under ``/proc``, is found), the task and its data, the model name, the host token, the
    placement on this process's devices (`check_placement`). Leaves nothing behind.

    Raises:
      Refused: with the one line ``a3po-train`` would print.
    """
    args = argparse.Namespace(experiment=experiment, overrides=overrides, replay=None)
    cfg = resolve_config(args)
    check_run_dir_creatable(cfg.run_dir)
    check_run_dir(cfg, resume=resume)
    preflight(cfg)
    check_placement(cfg)
    remove_empty_dirs(make_run_dir(cfg.run_dir))
    if cfg.system.run.compile_cache_dir:  # the run makes it at its start
        cache = os.path.expanduser(cfg.system.run.compile_cache_dir)
        remove_empty_dirs(make_run_dir(cache, "system.run.compile_cache_dir"))
    return cfg


def preflight(cfg: TrainConfig, *, replay: bool = False):
    """The checks of a valid config against the world, before the run is announced: the
    task builds and its split has prompts (a JSONL file's bad line is named here), the
    model name is a model, the remote hosts' token can be read. Returns the task. Reads
    only."""
    from a3po_jax.model.loader import check_model_name

    try:
        check_model_name(cfg.model.name)
    except FileNotFoundError as err:
        raise Refused(f"config error: {err}") from err
    if cfg.system.placement.inference_hosts:
        _read_token(cfg.system.placement.host_token_file)
    if cfg.system.run.compile_cache_dir:
        cache = os.path.expanduser(cfg.system.run.compile_cache_dir)
        check_run_dir_creatable(cache, "system.run.compile_cache_dir")
    from a3po_jax.tasks import make_task

    what = f"task.name={cfg.task.name!r} with task.options={cfg.task.options}"
    try:  # the task first: a bad task.options fails in a second, not after loading a model
        task = make_task(cfg.task.name, **cfg.task.kwargs)
    except (TypeError, ValueError, OSError) as err:
        raise Refused(f"config error: {what}: {err}") from err
    if replay:  # the groups come from the recording
        return task
    try:
        prompts = task.prompts(cfg.task.split)
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise Refused(f"config error: task.split={cfg.task.split!r} of {what}: {err}") from err
    if not prompts:
        raise Refused(f"config error: task.split={cfg.task.split!r} of {what} has no prompts")
    return task


def join_job():
    """This process's place in its job (`distributed.initialize`): several processes
    (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, as scripts/launch.py
    sets them) join one job before anything touches a device."""
    from a3po_jax.parallel import distributed

    try:
        return distributed.initialize()
    except ValueError as err:
        raise Refused(f"distributed setup: {err}") from err


def check_placement(cfg: TrainConfig) -> None:
    """The run's placement (meshes, the host's devices, the batch's parts) against this
    job's devices and the model's config, read without weights, so that a placement that
    cannot run is refused naming its fields before the model loads
    (`host_placement.check_placement`). Touches the devices: after `join_job`."""
    import jax

    from a3po_jax.model.loader import load_model_config
    from a3po_jax.training import host_placement

    model = cfg.model
    try:
        model_config = load_model_config(
            model.name,
            param_dtype=model.param_dtype,
            compute_dtype=model.compute_dtype,
            remat=model.remat,
        )
    except (OSError, ValueError) as err:
        raise Refused(
            f"config error: model.name={model.name!r}: cannot read its config: {err}"
        ) from err
    try:
        host_placement.check_placement(
            cfg, model_config, jax.device_count(), processes=jax.process_count()
        )
    except ValueError as err:
        raise Refused(f"config error: {err}") from err


def _start(
    args: argparse.Namespace, cfg: TrainConfig, start: int, task, stop: StopSignals, setup
) -> int:
    """Everything after the run was accepted and its job joined (`join_job`): announce,
    load, train."""
    leader = setup.process_id == 0

    # Heavy imports only once the config is known to be good.
    from a3po_jax.training.trainer import Trainer, load_policy

    say = _say if leader else (lambda message: None)
    print(
        f"a3po-train[{setup.process_id}/{setup.num_processes}]: mode={cfg.system.mode} "
        f"prox={cfg.algo.prox} loss={cfg.algo.loss} "
        f"model={cfg.model.name} task={cfg.task.name} steps={cfg.steps} -> {cfg.run_dir}",
        file=sys.stderr,
    )
    if args.resume:
        say(
            f"resuming {cfg.run_dir} from step {start} of {cfg.steps}"
            if start
            else f"--resume: no checkpoint to continue from in {cfg.run_dir} "
            f"(checkpoint_every={cfg.checkpoint_every}): starting at step 0"
        )
    say(f"loading model {cfg.model.name!r} ...")
    try:
        policy = load_policy(cfg.model)
    except (OSError, ValueError) as err:
        raise Refused(f"cannot load the model: {err}") from err
    host = None
    if cfg.system.placement.inference_hosts and leader:  # only process 0 talks to the hosts
        host = connect_hosts(cfg.system)
    say("building the train step and the inference host ...")
    try:
        trainer = Trainer(cfg, policy, host=host, task=task, replay_dir=args.replay)
    except ValueError as err:  # a combination this job cannot run (named in the message)
        raise Refused(str(err)) from err
    del policy  # the trainer holds its own copies of the weights: free the loaded ones
    say(f"step {start + 1}: compiling the train step and generating the first rollouts ...")
    try:
        trainer.run(resume=args.resume)
    except FileExistsError as err:  # checkpoints appeared since check_run_dir
        raise Refused(str(err)) from err
    stop.phase = "after training"
    if trainer.stop_signal:
        say(f"stopped by {trainer.stop_signal}: {stop.describe()}")
    if not leader:
        return 0
    if args.replay is not None:
        report_replay(args.replay, cfg.run_dir)
    print_run_report(cfg.run_dir)
    return 0


def print_run_report(run_dir: str | Path) -> None:
    """The end-of-run report on stdout (held-out accuracy start -> end, reward, steps, time,
    memory, staleness, drops), written with its plots to ``run_dir/report.md``
    (:func:`a3po_jax.analysis.run_report.write_run_report`)."""
    from a3po_jax.analysis.run_report import write_run_report

    print(write_run_report(run_dir, plots=report_plots()).terminal(), flush=True)


REPORT_PLOTS_ENV = "A3PO_REPORT_PLOTS"


def report_plots() -> bool:
    """Whether the end-of-run report draws its plots: the environment's
    ``A3PO_REPORT_PLOTS``, ``1`` (the default) or ``0``; any other value is refused."""
    value = os.environ.get(REPORT_PLOTS_ENV, "1")
    if value not in ("0", "1"):
        raise Refused(f"{REPORT_PLOTS_ENV}={value!r}: expected 0 (no plots) or 1 (plots)")
    return value == "1"


def report_replay(recorded_dir: str | Path, replay_dir: str | Path) -> dict:
    """Compare the replay's per-step losses with the recording's; print one line, log it
    and write ``replay_check.json`` in the replay's run dir."""
    from a3po_jax.training.recording import compare_runs

    check = compare_runs(recorded_dir, replay_dir)
    diffs = ", ".join(f"max |d {k}| = {v:.3g}" for k, v in check["max_abs_diff"].items())
    verdict = "match" if check["match"] else "DIFFER"
    line = f"replay of {recorded_dir}: {check['steps']} steps, {diffs}: {verdict}"
    _say(line)
    log.info(line)
    (Path(replay_dir) / "replay_check.json").write_text(json.dumps(check, indent=2))
    return check


def _say(message: str) -> None:
    """A progress line before work that is long and otherwise silent."""
    print(f"a3po-train: {message}", file=sys.stderr, flush=True)


def check_run_dir(cfg: TrainConfig, *, resume: bool) -> int:
    """The step the run starts from; refuses a fresh run into a run dir with checkpoints.

    Reads only: nothing in the run dir is created, moved or replaced.

    Raises:
      Refused: ``resume`` is false and ``cfg.run_dir`` holds a complete checkpoint.
    """
    step = latest_checkpoint_step(cfg.run_dir)
    if step and not resume:
        raise Refused(
            f"{cfg.run_dir} already has checkpoints (newest step {step}): pass --resume to "
            "continue that run, or choose a new run_dir=... (nothing was overwritten)"
        )
    # With checkpoint_every=0 the trainer keeps no checkpoints and restores none.
    return step if resume and cfg.checkpoint_every else 0


def _missing_dirs(run_dir: str, field: str = "run_dir") -> list[Path]:
    """The directories that creating ``run_dir`` would make, outermost first.

    Raises:
      Refused: the path cannot be a directory (an existing file on it, a name too long).
    """
    try:
        path = Path(run_dir).absolute()
        missing = []
        while not path.exists():
            missing.append(path)
            path = path.parent
        if not path.is_dir():
            raise Refused(f"config error: {field}={run_dir!r}: {path} is not a directory")
    except (OSError, ValueError) as err:
        raise Refused(f"config error: {field}={run_dir!r} cannot be used: {err}") from err
    return missing[::-1]


def check_run_dir_creatable(run_dir: str, field: str = "run_dir") -> None:
    """Refuses a run dir that cannot be made, or written in, without making it: its
    nearest existing directory must let this process create entries (``os.access``, which
    sees read-only filesystems even for root). :func:`make_run_dir` is the real test."""
    missing = _missing_dirs(run_dir, field)
    existing = missing[0].parent if missing else Path(run_dir).absolute()
    if not os.access(existing, os.W_OK | os.X_OK):
        raise Refused(f"config error: {field}={run_dir!r}: {existing} is not writable")


def make_run_dir(run_dir: str, field: str = "run_dir") -> list[Path]:
    """Creates ``run_dir`` and checks that a file can be made in it (an unnamed one, gone
    at once); returns the directories it created. Undoes its own directories and refuses
    when it cannot: nothing is left of a run dir that cannot hold the run. ``field`` is the
    setting the refusal names (another directory a run writes, as the compilation cache)."""
    check_run_dir_creatable(run_dir, field)
    created: list[Path] = []
    try:
        for directory in _missing_dirs(run_dir, field):
            try:
                directory.mkdir()
            except FileExistsError:  # another process of the job made it meanwhile
                continue
            created.append(directory)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as err:
        remove_empty_dirs(created)
        reason = err.strerror or str(err)
        raise Refused(
            f"config error: {field}={run_dir!r} cannot be created or written: {reason}"
            + (f" ({err.filename})" if err.filename else "")
        ) from err
    return created


def remove_empty_dirs(created: list[Path]) -> None:
    """Removes the directories :func:`make_run_dir` made, innermost first, while empty."""
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:
            return  # something was written there after all: keep it


def latest_checkpoint_step(run_dir: str | Path) -> int:
    """The newest complete checkpoint step in ``run_dir/checkpoints`` (0 if none).

    The steps orbax would restore from (committed step directories), found without opening
    an orbax manager, which would create the directory and move unfinished steps aside.
    """
    from a3po_jax.training.checkpointing import is_committed_step

    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return 0
    steps = [
        int(child.name)
        for child in directory.iterdir()
        if child.is_dir() and child.name.isdigit() and is_committed_step(child)
    ]
    return max(steps, default=0)


def connect_hosts(system):
    """A `HostPool` over the gRPC hosts of ``system.placement.inference_hosts`` (comma-separated;
    `a3po_jax.training.host_placement.host_pool`)."""
    from a3po_jax.training import host_placement

    token = _read_token(system.placement.host_token_file)
    addresses = [a.strip() for a in system.placement.inference_hosts.split(",") if a.strip()]
    if len(set(addresses)) != len(addresses):
        raise Refused(
            f"config error: system.placement.inference_hosts lists a host twice: {addresses}"
        )
    if system.placement.hosts_file:
        try:
            host_placement.check_hosts_file(addresses, system.placement.hosts_file)
        except (OSError, ValueError) as err:
            raise Refused(f"config error: {err}") from err
    return host_placement.host_pool(addresses, token, system)


def _read_token(path: str) -> str:
    if path:
        try:
            with open(os.path.expanduser(path)) as f:
                return f.read().strip()
        except OSError as err:
            raise Refused(
                f"config error: system.placement.host_token_file={path!r}: {err}"
            ) from err
    token = os.environ.get("A3PO_HOST_TOKEN", "")
    if not token:
        raise Refused(
            "config error: system.placement.inference_hosts (remote hosts) needs "
            "system.placement.host_token_file or A3PO_HOST_TOKEN"
        )
    return token


if __name__ == "__main__":
    sys.exit(main())
