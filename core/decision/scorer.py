"""StartLux-Decision: typed multiple-choice answers from the next-token logits of option letters.

Each question becomes one prompt (jevfmt), the model runs one forward pass, and the answer is read from the
logits of the option letters at the last prompt position, divided by the temperature of the question type
and normalised over the listed options. Nothing is generated.

Paths through the model:
- Eager: prompts sorted by length, right-padded to one of PAD_LENGTHS (the linear-attention kernels compile
  once per length), at most `max_batch_tokens` per pass. `decide_batch` sends every question of many
  requests through this path.
- CUDA graphs: on a GPU, `decide` replays a recorded graph: one per padded length for a single question,
  one per (questions, length) for 2-4 questions of up to 1024 tokens. Rows are right-padded without a mask:
  every layer is causal, so padding never reaches the position that is read.
One forward pass at a time (a lock): graphs share static buffers and callers may be on several threads.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass

import torch

from . import jevfmt as J
from .kernels import linear_attention_kernels

logger = logging.getLogger(__name__)

GRAPH_LENGTHS = (128, 192, 256, 320, 384, 512, 640, 768, 1024, 1536, 2048, 3072, 4096)
GRAPH_ROWS = (1, 2, 3, 4)
MULTI_ROW_MAX_LENGTH = 1024
PAD_LENGTHS = (128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
               5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384, 20480, 24576, 28672, 32768, 40960, 49152, 57344, 65536)


class DecisionValidationError(ValueError):
    """A request with bad questions; `errors` maps every bad question key (or "state"/"questions") to why."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{k}: {v}" for k, v in self.errors.items()))


class SlowKernelsError(RuntimeError):
    pass


def padded_length(n: int, fine: bool = False) -> int:
    """The length a batch whose longest input has n tokens is padded to. On CUDA the fla kernels compile once per
    length, so lengths come from PAD_LENGTHS; the torch path on a CPU compiles nothing and pads to a multiple of
    16 (`fine`)."""
    if fine:
        return -(-n // 16) * 16
    for length in PAD_LENGTHS:
        if n <= length:
            return length
    return -(-n // 8192) * 8192


def graph_shapes() -> list[tuple[int, int]]:
    """Every (rows, length) a graph is recorded for, largest first (they share one memory pool)."""
    shapes = [(b, n) for b in GRAPH_ROWS for n in GRAPH_LENGTHS if b == 1 or n <= MULTI_ROW_MAX_LENGTH]
    return sorted(shapes, key=lambda s: (-s[0] * s[1], -s[1]))


def pick_graph(lengths: list[int], shapes) -> tuple[int, int] | None:
    """The recorded (rows, length) that replays these prompts, or None when none fits."""
    if not lengths:
        return None
    longest = max(lengths)
    fits = [n for b, n in shapes if b == len(lengths) and n >= longest]
    return (len(lengths), min(fits)) if fits else None


def fill_static(ids: torch.Tensor, last: torch.Tensor, prompts: list[list[int]], pad: int) -> None:
    """Write prompts into a graph's static buffers: right-padded ids (rows, n) and each row's last position."""
    host = torch.full(ids.shape, pad, dtype=torch.long)
    for j, p in enumerate(prompts):
        host[j, :len(p)] = torch.tensor(p)
    ids.copy_(host)
    last.copy_(torch.tensor([len(p) - 1 for p in prompts]))


@dataclass
class _Prompt:
    key: str
    row: J.Row
    ids: list[int]


@dataclass
class _Prepared:
    questions: dict
    state_text: str
    answers: dict            # answered without the model (single-option choice)
    prompts: list[_Prompt]   # questions of at most max_options options, rendered
    wide: dict[str, list[_Prompt]]   # choice questions over max_options -> their rendered first-round prompts


class StartLuxDecision:
    """decide(state, questions) -> (answers, usage), answers in the TypeSafe /v1/systemone format."""

    def __init__(self, path: str, device=None, max_length: int = 65536, max_batch_tokens: int = 65536,
                 graphs: bool = True, dtype: torch.dtype | None = None):
        import transformers
        from transformers import AutoConfig, AutoTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: expected a local StartLux-Decision directory (weights are shared "
                                    f"separately)")
        cfg_path = os.path.join(path, "decision_config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{cfg_path}: missing")
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        self.path = path
        self.template = J.template_from(cfg)
        self.tok = AutoTokenizer.from_pretrained(path)
        self.letters = J.letter_token_ids(self.tok, self.template)
        if self.letters != cfg.get("letter_token_ids"):
            raise ValueError(f"{cfg_path}: letter_token_ids {cfg.get('letter_token_ids')} differ from the "
                             f"tokenizer's letter ids {self.letters}")
        self.temperature = {k: float(v) for k, v in cfg.get("temperature_by_type", {}).items()}
        wide = cfg.get("wide_choice", {})
        self.group, self.keep, self.residual = wide.get("group", 25), wide.get("keep", 3), wide.get("residual", 1e-3)
        # the most options one prompt shows; a question (or a round's finalists) with more goes through rounds
        self.max_options = wide.get("max_options", J.MAX_OPTIONS)
        if not 2 <= self.group <= self.max_options <= J.MAX_OPTIONS or not 1 <= self.keep < self.group:
            raise ValueError(f"{cfg_path}: wide_choice needs 2 <= group <= max_options <= 26 and 1 <= keep < group")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        config = AutoConfig.from_pretrained(path)
        arch = (config.architectures or [None])[0]
        if not arch or not hasattr(transformers, arch):
            raise ValueError(f"{path}/config.json: unknown architectures {config.architectures}")
        model_cls = getattr(transformers, arch)
        self.kernels = linear_attention_kernels(model_cls)
        slow = sorted(k for k, v in self.kernels.items() if v == "torch")
        if self.device.type == "cuda" and slow:
            msg = (f"the linear-attention kernels {slow} would run on transformers' torch reference path (>10x "
                   f"slower): pip install flash-linear-attention causal-conv1d, or set STARTLUX_ALLOW_SLOW=1")
            if os.environ.get("STARTLUX_ALLOW_SLOW") != "1":
                raise SlowKernelsError(msg)
            logger.warning(msg)
        model = model_cls.from_pretrained(path, dtype=self.dtype)
        # only the text decoder and the letter rows of the output head are kept
        self.body = getattr(model.model, "language_model", model.model).to(self.device).eval()
        head = model.get_output_embeddings().weight
        self.letter_rows = head.index_select(0, torch.tensor(self.letters)).float().to(self.device)
        del model, head
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else (self.tok.eos_token_id or 0)
        self.max_length, self.max_batch_tokens = int(max_length), int(max_batch_tokens)
        self._lock = threading.Lock()
        self.graphs: dict[tuple[int, int], tuple] = {}
        if graphs and self.device.type == "cuda" and os.environ.get("STARTLUX_GRAPHS", "1") != "0":
            self._capture()

    # ---- model passes
    def _slot_logits(self, ids: torch.Tensor, last: torch.Tensor, attn: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.body(input_ids=ids, attention_mask=attn, use_cache=False, return_dict=True).last_hidden_state
        h = hidden[torch.arange(ids.shape[0], device=ids.device), last].float()
        return h @ self.letter_rows.T

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for b, n in graph_shapes():
            ids = torch.full((b, n), self.pad, dtype=torch.long, device=self.device)
            last = torch.full((b,), n - 1, dtype=torch.long, device=self.device)
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(3):   # autotune and warm every kernel outside the capture
                    self._slot_logits(ids, last)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._slot_logits(ids, last)
            pool = graph.pool()
            self.graphs[(b, n)] = (graph, ids, last, out)
        logger.info("recorded %d CUDA graphs", len(self.graphs))

    def _graph_logits(self, shape, prompts: list[list[int]]) -> list[torch.Tensor]:
        graph, static_ids, last, out = self.graphs[shape]
        fill_static(static_ids, last, prompts, self.pad)
        graph.replay()
        res = out.cpu()
        return [res[j].clone() for j in range(len(prompts))]

    def _eager_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[torch.Tensor | None] = [None] * len(prompts)
        start = 0
        while start < len(order):
            longest = padded_length(len(prompts[order[start]]), fine=self.device.type != "cuda")
            n = max(1, min(len(order) - start, self.max_batch_tokens // longest))
            batch = order[start:start + n]
            start += n
            ids = torch.full((len(batch), longest), self.pad, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for j, i in enumerate(batch):
                ids[j, :len(prompts[i])] = torch.tensor(prompts[i])
                attn[j, :len(prompts[i])] = 1
            last = attn.sum(1) - 1
            logits = self._slot_logits(ids.to(self.device), last.to(self.device), attn.to(self.device)).cpu()
            for j, i in enumerate(batch):
                out[i] = logits[j]
        return out

    @torch.inference_mode()
    def _letter_logits(self, prompts: list[list[int]], use_graphs: bool = True) -> list[torch.Tensor]:
        """Logits of the 26 letters at the end of each prompt."""
        with self._lock:
            shape = pick_graph([len(p) for p in prompts], self.graphs) if use_graphs and self.graphs else None
            if shape is not None:
                return self._graph_logits(shape, prompts)
            return self._eager_logits(prompts)

    def _probs(self, prompts: list[_Prompt], use_graphs: bool = True) -> list[list[float]]:
        logits = self._letter_logits([p.ids for p in prompts], use_graphs) if prompts else []
        return [torch.softmax(z[:len(p.row.options)] / self.temperature.get(p.row.type, 1.0), -1).tolist()
                for p, z in zip(prompts, logits)]

    # ---- requests
    def _render(self, key: str, row: J.Row) -> _Prompt:
        ids, _ = J.render_ids(row, self.tok, [o.id for o in row.options], self.max_length, self.template)
        return _Prompt(key, row, ids)

    def _groups(self, keys: list[str]) -> list[list[str]]:
        n_groups = -(-len(keys) // self.group)
        size, extra = divmod(len(keys), n_groups)
        groups, start = [], 0
        for g in range(n_groups):
            end = start + size + (1 if g < extra else 0)
            groups.append(keys[start:end])
            start = end
        return groups

    def _sub_row(self, state_text: str, spec: dict, keys: list[str]) -> J.Row:
        crit = spec["criteria"]
        return J.from_systemone(None, dict(spec, criteria={k: crit[k] for k in keys}), self.template, state_text)

    def prepare(self, state, questions) -> _Prepared:
        """Validate and render a request. Raises DecisionValidationError naming every bad question; nothing runs."""
        errors: dict[str, str] = {}
        if not isinstance(questions, dict) or not questions:
            raise DecisionValidationError({"questions": "must be a non-empty object of key -> question"})
        try:
            state_text = J.render_state(state)
        except J.FormatError as e:
            raise DecisionValidationError({"state": str(e)}) from None
        answers, prompts, wide = {}, [], {}
        for key, q in questions.items():
            try:
                row = J.from_systemone(None, q, self.template, state_text)
                if row.type == "choice" and len(row.options) == 1:
                    only = row.options[0].id
                    answers[key] = {"type": "choice", "choice": only, "confidence": 1.0, "probabilities": {only: 1.0}}
                elif row.type == "choice" and len(row.options) > self.max_options:
                    # rendering every first-round prompt now checks that each fits; _wide reuses them
                    wide[key] = [self._render(key, self._sub_row(state_text, q, g))
                                 for g in self._groups([o.id for o in row.options])]
                else:
                    prompts.append(self._render(key, row))
            except J.FormatError as e:
                errors[str(key)] = str(e)
        if errors:
            raise DecisionValidationError(errors)
        return _Prepared(questions, state_text, answers, prompts, wide)

    def _wide(self, state_text: str, spec: dict, key: str,
              first_prompts: list[_Prompt] | None = None) -> tuple[dict[str, float], int]:
        """More than `max_options` (26) options: near-equal groups of at most `group`, the top `keep` of each go to
        a final round (itself a tournament while the finalists are more than `max_options`);
        the others share `residual` of the mass in proportion to their first-round probabilities."""
        keys = list(spec["criteria"])
        groups = self._groups(keys)
        if first_prompts is None:
            first_prompts = [self._render(key, self._sub_row(state_text, spec, g)) for g in groups]
        first = self._probs(first_prompts, use_graphs=False)
        tokens = sum(len(p.ids) for p in first_prompts)
        first_p = {k: p for g, ps in zip(groups, first) for k, p in zip(g, ps)}
        finalists = [k for g, ps in zip(groups, first)
                     for k, _ in sorted(zip(g, ps), key=lambda x: -x[1])[:self.keep]]
        fin_spec = dict(spec, criteria={k: spec["criteria"][k] for k in finalists})
        if len(finalists) > self.max_options:
            final_p, more = self._wide(state_text, fin_spec, key)
        else:
            final = self._render(key, self._sub_row(state_text, fin_spec, finalists))
            final_p, more = dict(zip(finalists, self._probs([final], use_graphs=False)[0])), len(final.ids)
        chosen = set(finalists)
        rest = [k for k in keys if k not in chosen]
        mass = sum(first_p[k] for k in rest) or 1.0
        probs = {k: final_p[k] * (1 - self.residual) for k in finalists}
        probs.update({k: self.residual * first_p[k] / mass for k in rest})
        z = sum(probs.values())
        return {k: probs[k] / z for k in keys}, tokens + more

    @staticmethod
    def _answer(row: J.Row, p: list[float]) -> dict:
        ids = [o.id for o in row.options]
        if row.type == "noul":
            return {"type": "noul", "noul": p[ids.index("true")]}
        if row.type == "score":
            return {"type": "score", "score": sum(i * v for i, v in enumerate(p)), "confidence": max(p),
                    "legend": {str(i): o.label for i, o in enumerate(row.options)},
                    "probabilities": {str(i): v for i, v in enumerate(p)}}
        dist = dict(zip(ids, p))
        best = max(dist, key=dist.get)
        return {"type": "choice", "choice": best, "confidence": dist[best], "probabilities": dist}

    def _finish(self, prep: _Prepared, probs: list[list[float]]) -> tuple[dict, dict]:
        answers = dict(prep.answers)
        tokens = sum(len(p.ids) for p in prep.prompts)
        for prompt, p in zip(prep.prompts, probs):
            answers[prompt.key] = self._answer(prompt.row, p)
        for key, first_prompts in prep.wide.items():
            dist, n = self._wide(prep.state_text, prep.questions[key], key, first_prompts)
            tokens += n
            best = max(dist, key=dist.get)
            answers[key] = {"type": "choice", "choice": best, "confidence": dist[best], "probabilities": dist}
        ordered = {k: answers[k] for k in prep.questions}
        return ordered, {"input_tokens": tokens, "output_tokens": 0}

    # ---- public API
    def decide(self, state, questions: dict) -> tuple[dict, dict]:
        """One request -> (answers, usage). On CUDA its questions replay one recorded graph when one fits."""
        prep = self.prepare(state, questions)
        return self._finish(prep, self._probs(prep.prompts))

    def decide_batch(self, requests: list, with_usage: bool = False, return_exceptions: bool = False) -> list:
        """[(state, questions), ...] -> [answers, ...] (or [(answers, usage), ...] with `with_usage`). Every question
        of every request goes through one length-sorted set of padded eager passes. With `return_exceptions`, a bad
        request's slot holds its DecisionValidationError and the others are still answered."""
        preps: list = []
        for state, questions in requests:
            try:
                preps.append(self.prepare(state, questions))
            except DecisionValidationError as e:
                if not return_exceptions:
                    raise
                preps.append(e)
        flat = [p for prep in preps if isinstance(prep, _Prepared) for p in prep.prompts]
        probs = self._probs(flat, use_graphs=False)
        out, i = [], 0
        for prep in preps:
            if not isinstance(prep, _Prepared):
                out.append(prep)
                continue
            answers, usage = self._finish(prep, probs[i:i + len(prep.prompts)])
            i += len(prep.prompts)
            out.append((answers, usage) if with_usage else answers)
        return out

    def self_test(self, state, questions: dict) -> float:
        """Largest |p_graph - p_eager| over the questions of one request (0.0 when no graphs were recorded)."""
        if not self.graphs:
            return 0.0
        prep = self.prepare(state, questions)
        graphed, eager = self._probs(prep.prompts), self._probs(prep.prompts, use_graphs=False)
        return max((abs(a - b) for pg, pe in zip(graphed, eager) for a, b in zip(pg, pe)), default=0.0)
