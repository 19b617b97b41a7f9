"""The ``mlxd`` command line: serve a config, or check one without loading the model."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from mlxd import __version__
from mlxd.assemble import load_everything
from mlxd.errors import ConfigError, MlxdError, ModelLoadError

DESCRIPTION = """\
mlxd serves an MLX language model over OpenAI-compatible HTTP endpoints, as a pipeline of stages
assembled from a TOML config.

  mlxd --config configs/default.toml            serve (host/port from the file's [server] table)
  mlxd --config FILE --host 0.0.0.0 --port 9000 serve, overriding the file's host and port
  mlxd check-config FILE [--host H] [--port N]   validate a config and its pipelines, check that every model's
                                                 source exists, print every setting's value and where it
                                                 came from (default, file, flag) and the pipeline; exit
                                                 non-zero naming the file, stage and field on errors
  mlxd --config FILE --log-file PATH             append log lines to PATH instead of stderr (SIGHUP reopens
                                                 it and re-reads the file's [logging] table)
  mlxd launch --config FILE                      start every rank of the file's [distributed] job through
                                                 mlx.launch (rank 0 serves HTTP); `mlxd --config FILE` run by
                                                 mlx.launch directly works too
  mlxd service install|uninstall|print --config FILE
                                                 write a launchd plist (macOS) or a systemd unit (Linux) that
                                                 runs this mlxd with FILE; see `mlxd service --help`

Exit codes: 0 after a clean shutdown (SIGTERM/SIGINT drain), 1 when the model fails to load or the engine
stops, 2 for a bad config or a missing model source, 128+N after a second signal N.

Environment: MLXD_CACHE_DIR (converted models; default ~/.cache/mlxd), MLXD_OPENBLAS=0 to run without
OpenBLAS on Linux, =pip or =system to choose the pip wheel's or the distribution's, or =/path/libopenblas.so.0; MLXD_API_KEYS and
MLXD_ADMIN_KEYS (comma separated) add to [server] api_keys_file and admin_keys_file.
"""


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxd", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", "-c", required=True, type=Path, help="daemon config (TOML)")
    parser.add_argument("--host", help="listen address (overrides [server] host)")
    parser.add_argument("--port", type=int, help="listen port (overrides [server] port)")
    parser.add_argument("--log-file", type=Path,
                        help="append log lines to this file instead of stderr; SIGHUP reopens it")
    parser.add_argument("--version", action="version", version=f"mlxd {__version__}")
    return parser


def check_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxd check-config",
        description="Validate a config without loading the model; print every setting's effective value and "
                    "where it came from (default, file or flag) and the assembled pipeline.",
    )
    parser.add_argument("config", type=Path, help="daemon config (TOML)")
    parser.add_argument("--host", help="as for serving: show the effect of overriding [server] host")
    parser.add_argument("--port", type=int, help="as for serving: show the effect of overriding [server] port")
    return parser


def serve_flags(args: argparse.Namespace) -> dict[str, object]:
    """The settings serve-time flags override, by dotted name (``server.port``)."""
    flags = {"server.host": args.host, "server.port": args.port}
    return {key: value for key, value in flags.items() if value is not None}


def check_model_sources(config, path: Path, *, at_start_only: bool = False) -> dict[str, Path]:
    """Each configured model's ``source`` checked (nothing loaded or downloaded; ``at_start_only``: the models loaded
    at start), their local paths by served name. A ``ModelLoadError`` names the file and the field of every model
    whose source is not there (``[model] source``, ``[models.NAME] source``)."""
    from mlxd.config.models import served_models
    from mlxd.models.load import check_source

    folders, errors, fields = {}, [], []
    for served in served_models(config):
        if at_start_only and served.load != "at_start":
            continue
        try:
            folders[served.name] = check_source(served.config.model.source, path.resolve().parent)
        except ModelLoadError as e:
            errors.append(f"{path}: [{served.table}] source: {e.message}")
            fields.append(f"{served.table}.source")
    if errors:
        raise ModelLoadError("\n".join(errors), param=fields[0])
    return folders


def check_config(argv: list[str]) -> int:
    args = check_parser().parse_args(argv)
    from mlxd.runtime.descriptors import check_mlx_lm_can_load

    check_mlx_lm_can_load()
    config, pipeline = load_everything(args.config)
    model = config.model
    folders = check_model_sources(config, args.config)
    folder = next(iter(folders.values()))  # the first model's: its sampling defaults are shown below
    from mlxd.api.auth import load_keys

    keys = load_keys(config.server, args.config.resolve().parent)  # a missing keys file fails here, not at start
    from mlxd.config.effective import apply_flags, effective_settings
    from mlxd.config.load import read_toml
    from mlxd.models.generation_config import model_sampling

    flags = serve_flags(args)
    print(f"{args.config}: OK")
    raw = read_toml(args.config)
    settings = effective_settings(apply_flags(config, flags), raw, flags,
                                  model_sampling=model_sampling(model.source, folder))
    if config.models:  # the shared tables once, then each model's own settings
        from mlxd.config.models import model_settings, served_models, shared_setting

        for (name, source), table in zip(folders.items(), config.models, strict=True):
            print(f"[models.{table}] {name}: source {source}")
        samplings = {served.name: model_sampling(served.config.model.source, folders[served.name])
                     for served in served_models(config)}
        settings = [s for s in settings if shared_setting(s)] + model_settings(config, raw, samplings)
    for setting in settings:
        print(setting.describe())
    print(f"api keys: {len(keys.api)} (admin: {len(keys.admin) or 'any valid key'})" if keys.enabled
          else "api keys: none (every endpoint is open)")
    if not config.models:
        print(pipeline.describe())
        return 0
    from mlxd.assemble import model_pipeline
    from mlxd.config.models import served_models

    for served in served_models(config):  # each model's own pipeline (they may differ)
        print(f"[{served.table}] {model_pipeline(served.config, args.config).describe()}")
    return 0


def serve(argv: list[str]) -> NoReturn:
    """Serve until stopped, then end the process (:func:`end_process`); errors before serving raise."""
    args = serve_parser().parse_args(argv)
    from mlxd.runtime.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas(sys.argv[1:])
    from mlxd.runtime.device import narrow_process

    narrow_process(args.config)  # before MLX is imported: importing it starts CUDA on every visible GPU
    from mlxd.runtime.descriptors import check_mlx_lm_can_load  # records the limit before mlx-lm lowers it

    check_mlx_lm_can_load()

    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # they would end the process; the server logs them once serving
        signal.signal(sig, signal.SIG_IGN)

    config, pipeline = load_everything(args.config)
    from mlxd.api.app import create_app
    from mlxd.config.effective import apply_flags
    from mlxd.daemon import Daemon
    from mlxd.log import configure_logging, get_logger
    from mlxd.server import run_server

    check_model_sources(config, args.config, at_start_only=True)  # a missing model loaded at start fails before the port

    config = apply_flags(config, serve_flags(args))
    server = config.server
    try:
        configure_logging(config.logging.level, config.logging.format, file=args.log_file)
    except OSError as e:
        raise ConfigError(f"--log-file {args.log_file}: cannot open it: {e.strerror or e}") from e
    base_dir = args.config.resolve().parent
    group = None
    if config.distributed is not None:
        from mlxd.engine.distributed.channel import init_group

        group = init_group(config.distributed)
        if group.rank() != 0:
            from mlxd.daemon import run_follower

            get_logger("mlxd").info("starting", config=str(args.config), rank=group.rank(), size=group.size())
            end_process(run_follower(config, group, base_dir))
    get_logger("mlxd").info("starting", config=str(args.config), host=server.host, port=server.port,
                            pipeline=[name for name, _ in pipeline.stages],
                            **({"rank": 0, "size": group.size()} if group is not None else {}))
    daemon = Daemon(config, pipeline, base_dir=base_dir, group=group, freeze_heap=True)
    end_process(run_server(create_app(daemon), daemon, config_path=args.config))


def end_process(code: int) -> NoReturn:
    """End the process with ``code`` once serving has stopped (the engine thread joined, every log line written),
    without the interpreter's teardown. Its C++ static destructors are where MLX 0.32's CUDA backend aborts
    (SIGABRT: exit status 134, "terminate called without an active exception") while it frees the cuDNN attention
    plans the engine thread built, which made every clean stop on an NVIDIA GPU look like a crash to systemd. Under
    ``[distributed]`` a thread may also be blocked inside a collective with a rank that is gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def openblas_env() -> int:
    """Print the ``export`` lines that preload the OpenBLAS mlxd would pick (with what it needs: the pip wheel's
    library needs the ``mlx-cpu`` wheel's gfortran), for a process mlxd does not start; mlxd preloads it itself."""
    import shlex

    from mlxd.runtime.blas import THREAD_TIMEOUT, find_openblas, preload_environment

    lib = find_openblas()
    if lib is None:
        print("mlxd: no OpenBLAS found (pip install cmeel-openblas, or apt-get install libopenblas0-pthread)",
              file=sys.stderr)
        return 1
    env = preload_environment(lib, os.environ)
    for key in ("LD_PRELOAD", "LD_LIBRARY_PATH", THREAD_TIMEOUT):
        if env.get(key) != os.environ.get(key):
            print(f"export {key}={shlex.quote(env[key])}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from mlxd.log import quiet_pytorch_notice

    quiet_pytorch_notice()  # every command imports transformers (through mlx-lm) sooner or later
    try:
        if argv and argv[0] == "check-config":
            return check_config(argv[1:])
        if argv and argv[0] == "launch":
            from mlxd.launch import main as launch_main

            return launch_main(argv[1:])
        if argv and argv[0] == "openblas-env":
            return openblas_env()
        if argv and argv[0] == "service":
            from mlxd.service import main as service_main

            return service_main(argv[1:])
        serve(argv)
    except MlxdError as e:
        print(f"mlxd: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
