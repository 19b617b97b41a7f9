"""The ``mlxd`` command line: serve a config, or check one without loading the model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlxd import __version__
from mlxd.errors import MlxdError

DESCRIPTION = """\
mlxd serves an MLX language model over OpenAI-compatible HTTP endpoints, as a pipeline of stages
assembled from a TOML config.

  mlxd --config configs/default.toml            serve (host/port from the file's [server] table)
  mlxd --config FILE --host 0.0.0.0 --port 9000 serve, overriding the file's host and port
  mlxd check-config FILE                         validate a config and its pipeline, check that the model
                                                 source exists, print the pipeline; exit non-zero naming
                                                 the file, stage and field on errors

Exit codes: 0 after a clean shutdown (SIGTERM/SIGINT drain), 1 when the model fails to load or the engine
stops, 2 for a bad config or a missing model source, 128+N after a second signal N.

Environment: MLXD_CACHE_DIR (converted models; default ~/.cache/mlxd), MLXD_OPENBLAS=0 to run without
OpenBLAS on Linux, or MLXD_OPENBLAS=/path/libopenblas.so.0 to choose the library.
"""


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxd", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", "-c", required=True, type=Path, help="daemon config (TOML)")
    parser.add_argument("--host", help="listen address (overrides [server] host)")
    parser.add_argument("--port", type=int, help="listen port (overrides [server] port)")
    parser.add_argument("--version", action="version", version=f"mlxd {__version__}")
    return parser


def check_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxd check-config", description="Validate a config without loading the model.")
    parser.add_argument("config", type=Path, help="daemon config (TOML)")
    return parser


def load_everything(path: Path):
    """Config + assembled pipeline, validated; nothing is loaded into memory yet."""
    from mlxd.config import load_config, resolve_pipeline
    from mlxd.pipeline.pipeline import build_pipeline

    config = load_config(path)
    source, tables = resolve_pipeline(config, path)
    return config, build_pipeline(tables, source)


def check_config(argv: list[str]) -> int:
    args = check_parser().parse_args(argv)
    config, pipeline = load_everything(args.config)
    model = config.model
    from mlxd.models.load import check_source

    check_source(model.source, args.config.resolve().parent)
    print(f"{args.config}: OK")
    print(f"model: {model.source} (kind={model.kind}, name={model.name or '(from source)'}, aliases={model.aliases})")
    print(f"server: {config.server.host}:{config.server.port}; engine: {config.engine.type}")
    print(pipeline.describe())
    return 0


def serve(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    from mlxd.runtime.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas(sys.argv[1:])
    config, pipeline = load_everything(args.config)
    import msgspec

    from mlxd.api.app import create_app
    from mlxd.daemon import Daemon
    from mlxd.log import configure_logging, get_logger
    from mlxd.models.load import check_source
    from mlxd.server import run_server

    check_source(config.model.source, args.config.resolve().parent)  # a missing model fails before the port

    server = msgspec.structs.replace(
        config.server, host=args.host or config.server.host, port=args.port or config.server.port
    )
    config = msgspec.structs.replace(config, server=server)
    configure_logging(config.logging.level, config.logging.format)
    get_logger("mlxd").info("starting", config=str(args.config), host=server.host, port=server.port,
                            pipeline=[name for name, _ in pipeline.stages])
    daemon = Daemon(config, pipeline, base_dir=args.config.resolve().parent)
    return run_server(create_app(daemon), daemon)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "check-config":
            return check_config(argv[1:])
        return serve(argv)
    except MlxdError as e:
        print(f"mlxd: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
