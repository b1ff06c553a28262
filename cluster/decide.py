"""`startlux decide INPUT OUTPUT [CONFIG]`: System One decisions over a whole dataset, on Ray Data.

INPUT is JSON Lines (each line one `/v1/systemone` request body; blank lines are skipped) or Parquet (a
`request` column holding each body as JSON text, or the body's fields as columns). OUTPUT gets, in input order,
one answer per request: the body the service would answer it with (its answers, or its refusal as the error
body the service sends with a 4xx), as JSON Lines, or as Parquet with `status` and `response` (JSON text)
columns when OUTPUT ends in `.parquet`. CONFIG is a Serve config (default: serve_config.cpu.yaml, as `startlux
serve`): its decision model (the first of a `models:` list) and the Ingress's limits apply, so a row is
answered or refused exactly as the service would answer that body.

The scorer runs as a Ray Data actor pool (`map_batches` with `DecideBatch`, a callable class: each actor loads
the model once, Ray Data forms its batches and feeds them in order); an actor lost mid-job is restarted and
its batch run again (Ray Data's defaults for actor pools: max_restarts and max_task_retries -1), so every row
is answered once. With GPUs in the cluster each actor takes one; else there is an actor per
`decision_torch_threads` CPUs (1 when unset), one CPU left to Ray Data's reads. Ray: the running instance when
this process has one, else `--address` (or $RAY_ADDRESS), else a local one started for the job (and stopped
with it). Prints Ray Data's progress bar and a summary: rows, refusals, rows/s.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import msgspec
import yaml

from core.decision.protocol import (Decided, DecisionModelInfo, DecisionRefused, DecisionRequest,
                                    DecisionValidationError, ScorerStart)
from deployments.bodies import parse_json, validated
from deployments.errors import APIError, error_response
from deployments.registry import Registry
from deployments.settings import AppArgs, DecisionSettings, IngressSettings, checkpoint_time
from deployments.systemone import DecisionRequest as Body


class DecideBatch:
    """The Ray Data callable class: one scorer per actor; a batch of request bodies (JSON text) -> their
    statuses and response bodies, each as the service answers it."""

    def __init__(self, settings: dict, limits: dict):
        from core.decision.process import build_scorer, scorer_info

        self.settings = DecisionSettings.model_validate(settings)
        self.limits = IngressSettings.model_validate(limits)
        s = self.settings
        self.scorer = build_scorer(ScorerStart(s.checkpoint, s.scorer, s.device, s.torch_threads))
        info = scorer_info(self.scorer)
        self.info = DecisionModelInfo(s.name, checkpoint_time(s.checkpoint), tuple(s.model_aliases), info.template)
        self.registry = Registry([{"kind": "decision", "names": [s.name, *s.model_aliases], "handle": None}])

    def parse(self, text: str) -> DecisionRequest | APIError:
        try:
            body = validated(Body, parse_json(text.encode(), self.limits.max_body_bytes, self.limits.max_json_depth))
            self.registry.get("decision", body.model)
            return body.check(self.info, self.limits)
        except APIError as e:
            return e

    def __call__(self, batch: dict) -> dict:
        parsed = [self.parse(str(t)) for t in batch["request"]]
        results = iter(self.scorer.decide_requests([p for p in parsed if isinstance(p, DecisionRequest)]))
        statuses, responses = [], []
        for p in parsed:
            res = next(results) if isinstance(p, DecisionRequest) else p
            if isinstance(res, DecisionValidationError):
                res = APIError.of(DecisionRefused(res.errors))
            if isinstance(res, APIError):
                answer = error_response(res.body)        # the status and bytes the service answers with
                statuses.append(answer.status_code)
                responses.append(answer.body.decode())
            else:
                statuses.append(200)
                responses.append(Decided(self.info.id, *res).wire_bytes().decode())
        return {"status": statuses, "response": responses}


def read_requests(path: str):
    """The input as a dataset of one `request` column (JSON text), in file order."""
    import ray.data

    if path.endswith(".parquet") or (os.path.isdir(path) and any(p.suffix == ".parquet" for p in Path(path).iterdir())):
        ds = ray.data.read_parquet(path)
        if "request" in ds.schema().names:
            return ds.select_columns(["request"])
        return ds.map(lambda row: {"request": json.dumps(row, default=_plain)})
    return ray.data.read_text(path, drop_empty_lines=True).rename_columns({"text": "request"})


def _plain(value):
    """A Parquet value json cannot write (Arrow lists arrive as numpy arrays) as the JSON value it holds."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def load_config(config: str | None) -> tuple[DecisionSettings, IngressSettings]:
    """CONFIG's first application's decision model (the first of `models:`) and its Ingress's limits."""
    from cluster.cli import default_config

    path = Path(config) if config else default_config()
    cfg = yaml.safe_load(path.read_text())
    args = AppArgs.model_validate(cfg["applications"][0].get("args") or {})
    decisions = [m for m in args.served_models() if m.kind == "decision"]
    if not decisions:
        raise SystemExit(f"startlux decide: {path} serves no decision model")
    return decisions[0].settings, args.ingress


def run(input_path: str, output_path: str, config: str | None = None, actors: int | None = None,
        batch_size: int | None = None, address: str | None = None, quiet: bool = False) -> dict:
    """The job; returns its summary (rows, answered, refused, seconds, rows_per_s)."""
    import ray
    import ray.data

    from deployments.settings import BatchSettings

    settings, limits = load_config(config)
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus and settings.device in (None, "cuda"):
        resources = {"num_gpus": 1}
        settings = settings.model_copy(update={"device": "cuda"})
        actors = actors or gpus
    else:
        # one CPU reserved per actor, whatever its torch threads use: reserving them all could leave none for
        # Ray Data's read tasks on a small machine, and the job would wait forever
        resources = {"num_cpus": 1}
        settings = settings.model_copy(update={"device": settings.device or "cpu"})
        cpus = int(ray.cluster_resources().get("CPU", 1))
        actors = actors or max(1, (cpus - 1) // (settings.torch_threads or 1))
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds = read_requests(input_path).map_batches(
        DecideBatch, batch_size=batch_size or BatchSettings().max_batch_size, concurrency=actors,
        fn_constructor_kwargs={"settings": settings.model_dump(mode="json"), "limits": limits.model_dump(mode="json")},
        batch_format="numpy", **resources)
    t0, rows, refused = time.perf_counter(), 0, 0
    out = Path(output_path)
    if output_path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer = None
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            table = pa.table({"status": batch["status"].cast(pa.int32()), "response": batch["response"]})
            writer = writer or pq.ParquetWriter(out, table.schema)
            writer.write_table(table)
            rows, refused = rows + len(table), refused + sum(s != 200 for s in table["status"].to_pylist())
        if writer is None:
            pq.write_table(pa.table({"status": pa.array([], pa.int32()), "response": pa.array([], pa.string())}), out)
        else:
            writer.close()
    else:
        with open(out, "w", encoding="utf-8") as f:
            for batch in ds.iter_batches(batch_format="numpy", batch_size=None):
                for status, response in zip(batch["status"], batch["response"]):
                    f.write(f"{response}\n")
                    rows, refused = rows + 1, refused + (int(status) != 200)
    seconds = time.perf_counter() - t0
    summary = {"rows": rows, "answered": rows - refused, "refused": refused, "seconds": round(seconds, 3),
               "rows_per_s": round(rows / seconds, 2) if seconds else 0.0, "actors": actors,
               "device": settings.device}
    if not quiet:
        print(f"startlux decide: {rows} rows ({rows - refused} answered, {refused} refused) in {seconds:.1f} s, "
              f"{summary['rows_per_s']} rows/s, {actors} actor{'s' * (actors > 1)} on {settings.device}; "
              f"wrote {out}", file=sys.stderr)
    return summary


def main(known) -> int:
    summary = run(known.input, known.output, known.config, known.actors, known.batch_size, known.address)
    print(msgspec.json.encode(summary).decode())
    return 0
