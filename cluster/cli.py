"""`startlux`: the service's command.

    startlux serve [CONFIG] [serve run's options]

starts the service as `serve run CONFIG` does (CONFIG: serve_config.cpu.yaml in the current directory, else
the one beside this package's source), with the Ray settings the quick start needs as defaults. Each is set
only where the environment does not set it already, so any of them can be overridden (`RAY_SERVE_ENABLE_HA_PROXY=0
startlux serve`); docs/configuration.md says what each does. The process then becomes `serve run` (exec, the
same pid): Ctrl-C, SIGTERM and a supervisor's signals reach Ray's own CLI as they would from a terminal.
Production runs `serve run serve_config.yaml` (or `serve deploy`) with these variables in its manifests.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
SOURCE_ROOT = Path(__file__).resolve().parent.parent


# The service's Ray settings, the one place they are written (docs/configuration.md#ray-serves-throughput-mode-
# and-haproxy): the tests and the local cluster take THROUGHPUT, `startlux serve` all of ray_defaults(), and
# tests/test_cluster_manifests.py holds the production manifests to the same values.
THROUGHPUT = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}     # Serve's high-throughput request path, in every Ray process
HAPROXY = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}             # HAProxy on the HTTP port
LAUNCHER = "startlux-haproxy"                            # our launcher of it (RAY_SERVE_HAPROXY_BINARY_PATH)


def ray_defaults() -> dict[str, str]:
    """The Ray settings of a single-machine start."""
    return {**THROUGHPUT, **HAPROXY, "RAY_SERVE_HAPROXY_BINARY_PATH": str(BIN / LAUNCHER),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}   # Ray's local cluster on 127.0.0.1


def default_config() -> Path:
    here = Path("serve_config.cpu.yaml")
    return here if here.exists() else SOURCE_ROOT / "serve_config.cpu.yaml"


def serve(config: str | None, extra: list[str]) -> None:
    path = Path(config) if config else default_config()
    if not path.is_file():
        sys.exit(f"startlux serve: no config file {path}")
    for key, value in ray_defaults().items():
        os.environ.setdefault(key, value)
    argv = [str(BIN / "serve"), "run", str(path), *extra]
    os.execv(argv[0], argv)


def main(args: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="startlux", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the service (serve run CONFIG with the quick start's Ray settings)")
    s.add_argument("config", nargs="?", help="a Serve config file (default: serve_config.cpu.yaml)")
    known, extra = p.parse_known_args(args)
    if known.command == "serve":
        serve(known.config, extra)


if __name__ == "__main__":
    main()
