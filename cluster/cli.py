"""`startlux`: the service's command.

    startlux serve [CONFIG] [--chat-checkpoint DIR] [serve run's options]
    startlux chat [--url URL] [--api-key KEY] [--system TEXT] [--max-tokens N] [--temperature T] [--once TEXT]
    startlux decide INPUT OUTPUT [CONFIG] [--actors N] [--batch-size N] [--address ADDR]

starts the service as `serve run CONFIG` does (CONFIG: serve_config.cpu.yaml in the current directory, else
the one beside this package's source), with the Ray settings the quick start needs as defaults. Each is set
only where the environment does not set it already, so any of them can be overridden (`RAY_SERVE_ENABLE_HA_PROXY=0
startlux serve`); docs/configuration.md says what each does. The process then becomes `serve run` (exec, the
same pid): Ctrl-C, SIGTERM and a supervisor's signals reach Ray's own CLI as they would from a terminal.
Production runs `serve run serve_config.yaml` (or `serve deploy`) with these variables in its manifests.
`--chat-checkpoint DIR` serves another chat checkpoint (one `python -m core.chat.convert` wrote): CONFIG with its
`chat_checkpoint` set to DIR, written beside the temporary files of this run.

`startlux chat` is a terminal chat with a running service: each line typed is a user turn, the reply streams
as it is generated, and the conversation (with the calculator parts of each reply) goes back with the next
turn; an empty line or end of input ends it. `--once TEXT` asks one question and exits (0, or 1 on an error).
It speaks the service's public /v1/chat/completions, so it works against any replica or proxy of it.

`startlux decide` answers a file of System One requests offline on Ray Data, as the service would answer each
(cluster/decide.py, docs/deployment.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
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


def with_chat_checkpoint(config: Path, checkpoint: str) -> Path:
    """A copy of `config` whose applications serve the chat checkpoint `checkpoint` (made absolute)."""
    import tempfile

    import yaml

    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        sys.exit(f"startlux serve: {checkpoint} is not a chat checkpoint (no config.json); "
                 "python -m core.chat.convert writes one")
    cfg = yaml.safe_load(config.read_text())
    for app in cfg.get("applications", []):
        app.setdefault("args", {})["chat_checkpoint"] = os.path.abspath(checkpoint)
    fd, path = tempfile.mkstemp(prefix="startlux-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return Path(path)


def serve(config: str | None, extra: list[str], chat_checkpoint: str | None = None) -> None:
    path = Path(config) if config else default_config()
    if not path.is_file():
        sys.exit(f"startlux serve: no config file {path}")
    if chat_checkpoint:
        path = with_chat_checkpoint(path, chat_checkpoint)
    for key, value in ray_defaults().items():
        os.environ.setdefault(key, value)
    argv = [str(BIN / "serve"), "run", str(path), *extra]
    os.execv(argv[0], argv)


class ChatError(RuntimeError):
    """The service answered a turn with an error (its message), or could not be reached."""


def chat_turn(url: str, messages: list[dict], options: dict, api_key: str | None, out) -> dict:
    """One streamed chat completion of `messages`: its text written to `out` as it arrives; -> the assistant
    turn to send back (with `parts`, the reply's calculator calls and results, when it has them)."""
    body = json.dumps({"messages": messages, "stream": True, **options}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/chat/completions", body, headers)
    text, parts = [], []
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ChatError(chunk["error"]["message"])
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    if delta.get("content"):
                        text.append(delta["content"])
                        if parts and parts[-1]["type"] == "text":
                            parts[-1]["text"] += delta["content"]
                        else:
                            parts.append({"type": "text", "text": delta["content"]})
                        out.write(delta["content"])
                        out.flush()
                    for part in delta.get("parts") or ():
                        parts.append(part)
                        out.write(f"[{part['type']}: {part['text']}]")
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {e.code}"
        raise ChatError(message) from None
    except urllib.error.URLError as e:
        raise ChatError(f"{url} does not answer ({e.reason}): is the service running?") from None
    out.write("\n")
    turn = {"role": "assistant", "content": "".join(text)}
    if any(p["type"] != "text" for p in parts):
        turn["parts"] = parts
    return turn


def chat(known: argparse.Namespace, stdin=sys.stdin, out=sys.stdout) -> int:
    messages = [{"role": "system", "content": known.system}] if known.system else []
    options = {k: v for k, v in (("max_tokens", known.max_tokens), ("temperature", known.temperature)) if v is not None}
    key = known.api_key or os.environ.get("STARTLUX_API_KEY")

    def typed():
        while True:
            out.write("> ")
            out.flush()
            if not (text := stdin.readline().rstrip("\n")):
                return
            yield text
    for text in [known.once] if known.once is not None else typed():
        messages.append({"role": "user", "content": text})
        try:
            messages.append(chat_turn(known.url, messages, options, key, out))
        except ChatError as e:
            out.write(f"error: {e}\n")
            messages.pop()              # the turn was not answered: it is not part of the conversation
            if known.once is not None:
                return 1
    return 0


def main(args: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="startlux", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the service (serve run CONFIG with the quick start's Ray settings)")
    s.add_argument("config", nargs="?", help="a Serve config file (default: serve_config.cpu.yaml)")
    s.add_argument("--chat-checkpoint", metavar="DIR", help="serve this chat checkpoint instead of the config's")
    c = sub.add_parser("chat", help="a terminal chat with a running service")
    c.add_argument("--url", default="http://127.0.0.1:8000")
    c.add_argument("--api-key", help="sent as Authorization: Bearer (default: $STARTLUX_API_KEY)")
    c.add_argument("--system", help="a system message first")
    c.add_argument("--max-tokens", type=int)
    c.add_argument("--temperature", type=float)
    c.add_argument("--once", metavar="TEXT", help="ask this one question, print the reply and exit")
    d = sub.add_parser("decide", help="System One decisions over a dataset (JSON Lines or Parquet) on Ray Data")
    d.add_argument("input", help="JSON Lines (one request body a line) or Parquet")
    d.add_argument("output", help="the answers in input order: JSON Lines, or Parquet when it ends in .parquet")
    d.add_argument("config", nargs="?", help="a Serve config whose decision model and limits apply "
                                             "(default: serve_config.cpu.yaml)")
    d.add_argument("--actors", type=int, help="scorer actors (default: one per GPU, else per CPUs it takes)")
    d.add_argument("--batch-size", type=int, help="requests per batch (default: the deployment's, 16)")
    d.add_argument("--address", help="a Ray cluster to run on (default: $RAY_ADDRESS, else a local instance)")
    known, extra = p.parse_known_args(args)
    if known.command == "decide" and not extra:
        from cluster.decide import main as decide_main
        sys.exit(decide_main(known))
    if known.command == "serve":
        serve(known.config, extra, known.chat_checkpoint)
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    else:
        try:
            sys.exit(chat(known))
        except KeyboardInterrupt:        # Ctrl-C: the reply stops (its connection closes, the engine frees it)
            print()
            sys.exit(130)


if __name__ == "__main__":
    main()
