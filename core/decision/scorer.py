"""StartLux-Decision: typed multiple-choice answers from the next-token logits of option letters.

Each question becomes one prompt (jevfmt): the request's state block, then the question block (its tail).
The answer is read from the logits of the option letters at the last prompt position, divided by the
temperature of the question type and normalised over the listed options. Nothing is generated.

Paths through the model:
- Shared prefix (the default): the state block runs once per distinct prefix (per request, and once for
  all requests of a batch that carry the same state; a byte-bounded LRU keeps prefix states across requests,
  prefix_cache.py), and each question's tail continues from it; tails share passes as `passes.plan` decides.
  A state that must be cut is cut once per request, to fit its longest question.
- Full prompts (`share_prefix=False`, the seed's way): every prompt runs whole, sorted by length,
  right-padded with a mask, at most `max_batch_tokens` per pass.
- CUDA graphs: on a GPU, `decide` replays a recorded pass over whole prompts when one fits, and the shared
  prefix path's tail passes replay recorded tail graphs when a bucket holds them (graphs.py).
One forward pass at a time (a lock): graphs share static buffers and callers may be on several threads.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass

import torch

from . import jevfmt as J
from .config import CheckpointConfig, DecisionConfig
from .graphs import PromptGraphs, TailGraphs
from .kernels import linear_attention_kernels
from .passes import PassCost, plan
from .prefix_cache import PrefixCache, PrefixState, batch_cache, cache_of
from .protocol import (DecisionRequest, DecisionValidationError, InputTokensDetails, Invalid, NoulAnswer, Question,
                       ScoreAnswer, Usage, choice_answer, decide_wire)

logger = logging.getLogger(__name__)

PAD_LENGTHS = (128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
               5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384, 20480, 24576, 28672, 32768, 40960, 49152, 57344, 65536)


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


@dataclass
class _Prompt:
    key: str
    row: J.Row
    prefix: list[int]        # the state block (shared by the request's questions)
    tail: list[int]          # the question block
    request: int = 0         # which request of a batch it belongs to
    cached: int = 0          # prefix tokens served from the prefix cache, not computed for this request

    @property
    def ids(self) -> list[int]:
        return self.prefix + self.tail


@dataclass
class _Prepared:
    questions: dict[str, Question]
    state_text: str
    block: J.StateBlock
    prefix: list[int]        # the request's state block, cut once to fit its longest question
    answers: dict            # answered without the model (single-option choice)
    prompts: list[_Prompt]   # questions of at most max_options options, rendered
    wide: dict[str, list[_Prompt]]   # choice questions over max_options -> their rendered first-round prompts


class StartLuxDecision:
    """decide(state, questions) -> (answers, usage), answers in the System One /v1/systemone format."""

    def __init__(self, path: str, config: DecisionConfig | None = None, device=None, dtype: torch.dtype | None = None,
                 **settings):
        """config: the scorer's settings (DecisionConfig); keyword `settings` override single fields of it
        (`StartLuxDecision(path, max_length=120)`)."""
        import transformers
        from transformers import AutoConfig, AutoTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: expected a local StartLux-Decision directory (weights are shared "
                                    f"separately)")
        checkpoint = CheckpointConfig.read(path)
        config = dataclasses.replace(config or DecisionConfig(), **settings)
        self.config, self.path, self.checkpoint = config, path, checkpoint
        self.template = J.template_from({"template": checkpoint.template})
        self.tok = AutoTokenizer.from_pretrained(path)
        self.letters = J.letter_token_ids(self.tok, self.template)
        if self.letters != checkpoint.letter_token_ids:
            raise ValueError(f"{path}/decision_config.json: letter_token_ids {checkpoint.letter_token_ids} differ "
                             f"from the tokenizer's letter ids {self.letters}")
        wide = checkpoint.wide_choice
        self.group, self.keep, self.residual = wide.group, wide.keep, wide.residual
        # the most options one prompt shows; a question (or a round's finalists) with more goes through rounds
        self.max_options = wide.max_options
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model_config = AutoConfig.from_pretrained(path)
        arch = (model_config.architectures or [None])[0]
        if not arch or not hasattr(transformers, arch):
            raise ValueError(f"{path}/config.json: unknown architectures {model_config.architectures}")
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
        self.max_length, self.max_batch_tokens = config.max_length, config.max_batch_tokens
        self._lock = threading.Lock()
        self.share_prefix = config.share_prefix
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes)
        self.pass_cost = PassCost.of(self.body, self.device.type)
        self.kinds = list(getattr(self.body.config, "layer_types", []))
        self.graphs: PromptGraphs | None = None
        self.tail_graphs: TailGraphs | None = None
        if config.graphs and self.device.type == "cuda" and os.environ.get("STARTLUX_GRAPHS", "1") != "0":
            self.graphs = PromptGraphs(self._slot_logits, self.device, self.pad)
            if self.share_prefix:
                self.tail_graphs = self.new_tail_graphs()

    def new_tail_graphs(self, shapes=None, capture: bool = True) -> TailGraphs | None:
        """Tail graphs for this model (graphs.TailGraphs; None when its attention cannot take the 4-D mask they
        pass). `capture=False` records nothing: replays run the same static pass eagerly (the CPU tests)."""
        if getattr(self.body.config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
            return None
        return TailGraphs(self._static_tail_logits, self._prefix_state([self.pad] * 2), self.device, self.pad,
                          shapes, capture)

    # ---- model passes
    def _slot_logits(self, ids: torch.Tensor, last: torch.Tensor, attn: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.body(input_ids=ids, attention_mask=attn, use_cache=False, return_dict=True).last_hidden_state
        h = hidden[torch.arange(ids.shape[0], device=ids.device), last].float()
        return h @ self.letter_rows.T

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
    def _prefix_state(self, ids: list[int]) -> PrefixState:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.body.config)
        self.body(input_ids=torch.tensor([ids], device=self.device), past_key_values=cache, use_cache=True)
        return PrefixState.capture(cache, self.kinds, len(ids))

    def _static_tail_logits(self, buffers, prefix: int) -> torch.Tensor:
        """The tail pass over one bucket's static buffers (graphs.TailBuffers), as a CUDA graph records it: tensor
        ops only, shapes fixed by the bucket. Keys are the bucket's `prefix` positions (each row's state
        right-aligned in them) then the tail's; a row sees its own prefix and the tail causally, and its
        positions continue from its prefix length, as in `_tail_logits`."""
        ids, lengths = buffers.ids, buffers.lengths
        rows, width = ids.shape
        cache = cache_of(self.body.config, self.kinds, buffers.layers)
        keys = torch.arange(prefix + width, device=ids.device)
        queries = torch.arange(width, device=ids.device)
        own_prefix = (keys < prefix) & (keys >= (prefix - lengths)[:, None])              # (rows, keys)
        causal_tail = (keys >= prefix) & (keys - prefix <= queries[:, None])             # (width, keys)
        seen = (own_prefix[:, None, :] | causal_tail[None]).unsqueeze(1)                 # (rows, 1, width, keys)
        if self.body.config._attn_implementation != "sdpa":     # eager attention adds its mask
            seen = torch.zeros(seen.shape, dtype=self.dtype, device=ids.device).masked_fill(
                ~seen, torch.finfo(self.dtype).min)
        positions = lengths[:, None] + queries
        hidden = self.body(input_ids=ids, attention_mask={"full_attention": seen, "linear_attention": None},
                           position_ids=positions, past_key_values=cache, use_cache=True,
                           return_dict=True).last_hidden_state
        h = hidden[torch.arange(rows, device=ids.device), buffers.last].float()
        return h @ self.letter_rows.T

    @torch.inference_mode()
    def _tail_logits(self, states: list[PrefixState | None], tails: list[list[int]]) -> torch.Tensor:
        """One pass over `tails`, each continuing from its prefix state: right-padded tails, left-padded keys. On
        a GPU a recorded tail graph replays it when one holds the pass."""
        shape = self.tail_graphs.shape_for(states, tails) if self.tail_graphs is not None else None
        if shape is not None:
            return self.tail_graphs.replay(shape, states, tails)
        cache, longest = batch_cache(self.body.config, states)
        width = max(len(t) for t in tails)
        ids = torch.full((len(tails), width), self.pad, dtype=torch.long)
        for j, t in enumerate(tails):
            ids[j, :len(t)] = torch.tensor(t)
        lengths = [s.length if s is not None else 0 for s in states]
        mask = positions = None
        if cache is not None and min(lengths) < longest:
            mask = torch.ones((len(tails), longest + width), dtype=torch.long)
            positions = torch.arange(width).repeat(len(tails), 1)
            for j, n in enumerate(lengths):
                mask[j, :longest - n] = 0
                positions[j] += n
            mask, positions = mask.to(self.device), positions.to(self.device)
        hidden = self.body(input_ids=ids.to(self.device), attention_mask=mask, position_ids=positions,
                           past_key_values=cache, use_cache=cache is not None, return_dict=True).last_hidden_state
        last = torch.tensor([len(t) - 1 for t in tails], device=self.device)
        h = hidden[torch.arange(len(tails), device=self.device), last].float()
        return (h @ self.letter_rows.T).cpu()

    def _shared_logits(self, prompts: list[_Prompt], owners: dict) -> list[torch.Tensor]:
        """Each distinct prefix once (from the prefix cache when it holds it), then the tails in planned passes.
        `owners` maps the prefixes computed in this call to the request that computed them; a prompt whose prefix
        it did not compute itself is marked `cached`."""
        states: dict[tuple[int, ...], PrefixState] = {}
        for p in prompts:
            key = tuple(p.prefix)
            if key and key not in states:
                state = self.prefix_cache.get(key)
                if state is None:
                    state = self._prefix_state(p.prefix)
                    self.prefix_cache.put(key, state)
                    owners.setdefault(key, p.request)
                else:
                    owners.setdefault(key, -1)           # an earlier call computed it
                states[key] = state
            p.cached = len(key) if key and owners[key] != p.request else 0
        rows = [(len(p.prefix), len(p.tail)) for p in prompts]
        out: list[torch.Tensor | None] = [None] * len(prompts)
        for group in plan(rows, self.max_batch_tokens, self.pass_cost):
            logits = self._tail_logits([states.get(tuple(prompts[i].prefix)) for i in group],
                                       [prompts[i].tail for i in group])
            for j, i in enumerate(group):
                out[i] = logits[j]
        return out

    def _letter_logits(self, prompts: list[_Prompt], owners: dict, use_graphs: bool = True) -> list[torch.Tensor]:
        """Logits of the 26 letters at the end of each prompt."""
        with self._lock:
            shape = self.graphs.shape_for([p.ids for p in prompts]) if use_graphs and self.graphs else None
            if shape is not None:
                return self.graphs.replay(shape, [p.ids for p in prompts])
            if self.share_prefix:
                return self._shared_logits(prompts, owners)
            return self._eager_logits([p.ids for p in prompts])

    def _probs(self, prompts: list[_Prompt], owners: dict, use_graphs: bool = True) -> list[list[float]]:
        logits = self._letter_logits(prompts, owners, use_graphs) if prompts else []
        return [torch.softmax(z[:len(p.row.options)] / self.checkpoint.temperature(p.row.type), -1).tolist()
                for p, z in zip(prompts, logits)]

    # ---- requests
    def _tail(self, row: J.Row) -> list[int]:
        return J.render_tail(row, self.tok, [o.id for o in row.options], self.template)

    def _prompt(self, key: str, row: J.Row, tail: list[int], prep: _Prepared, request: int) -> _Prompt:
        """A prompt on the request's shared prefix; a tail too long for it (a later tournament round) gets the
        state cut to fit itself instead."""
        prefix = prep.prefix
        if len(prefix) + len(tail) > self.max_length:
            prefix, _ = prep.block.ids(self.max_length - len(tail))
        return _Prompt(key, row, prefix, tail, request)

    def _groups(self, keys: list[str]) -> list[list[str]]:
        n_groups = -(-len(keys) // self.group)
        size, extra = divmod(len(keys), n_groups)
        groups, start = [], 0
        for g in range(n_groups):
            end = start + size + (1 if g < extra else 0)
            groups.append(keys[start:end])
            start = end
        return groups

    def _sub_row(self, state_text: str, question: Question, keys: list[str]) -> J.Row:
        return J.row_of(question.narrowed(keys), state_text)

    def prepare(self, request: DecisionRequest, index: int = 0) -> _Prepared:
        """Render a parsed request. Raises DecisionValidationError naming every bad question (those that did not
        parse and those too long for max_length); nothing runs. The state is tokenized once and cut once, to
        leave room for the request's longest question block."""
        errors: dict[str, str] = {}
        state_text = request.state
        block = J.StateBlock.of(state_text, self.tok, self.template)
        answers: dict = {}
        plain: list[tuple[str, J.Row, list[int]]] = []
        wide: dict[str, list[tuple[J.Row, list[int]]]] = {}
        for key, q in request.questions.items():
            if isinstance(q, Invalid):
                errors[str(key)] = q.message
                continue
            try:
                row = J.row_of(q, state_text)
                if row.type == "choice" and len(row.options) == 1:
                    answers[key] = choice_answer({row.options[0].id: 1.0})
                    continue
                if row.type == "choice" and len(row.options) > self.max_options:
                    subs = [self._sub_row(state_text, q, g) for g in self._groups([o.id for o in row.options])]
                    tails = [(sub, self._tail(sub)) for sub in subs]
                else:
                    tails = [(row, self._tail(row))]
                for _, tail in tails:        # every prompt must fit, with the state cut as far as it goes
                    if len(tail) + block.shortest > self.max_length:
                        raise J.QuestionTooLong(f"the question and its options need {len(tail)} tokens (with the state "
                                              f"cut away, more); max_length is {self.max_length}")
                if row.type == "choice" and len(row.options) > self.max_options:
                    wide[key] = tails
                else:
                    plain.append((key, row, tails[0][1]))
            except J.FormatError as e:
                errors[str(key)] = str(e)
        if errors:
            raise DecisionValidationError(errors)
        longest = max([len(t) for _, _, t in plain] + [len(t) for ts in wide.values() for _, t in ts], default=0)
        prefix = block.ids(self.max_length - longest)[0] if (plain or wide) else []
        parsed = {k: q for k, q in request.questions.items() if isinstance(q, Question)}
        prep = _Prepared(parsed, state_text, block, prefix, answers, [], {})
        prep.prompts = [self._prompt(key, row, tail, prep, index) for key, row, tail in plain]
        prep.wide = {key: [self._prompt(key, row, tail, prep, index) for row, tail in ts] for key, ts in wide.items()}
        return prep

    def _wide(self, prep: _Prepared, question: Question, key: str, owners: dict, request: int,
              first_prompts: list[_Prompt] | None = None) -> tuple[dict[str, float], int, int]:
        """More than `max_options` options: near-equal groups of at most `group`, the top `keep` of each go to a
        final round (itself a tournament while the finalists are more than `max_options`); the others share
        `residual` of the mass in proportion to their first-round probabilities. Every round's prompts continue
        from the request's shared prefix. -> (probabilities, prompt tokens, cached tokens)."""
        keys = [o.id for o in question.options]
        groups = self._groups(keys)
        if first_prompts is None:
            rows = [self._sub_row(prep.state_text, question, g) for g in groups]
            first_prompts = [self._prompt(key, r, self._tail(r), prep, request) for r in rows]
        first = self._probs(first_prompts, owners, use_graphs=False)
        tokens = sum(len(p.ids) for p in first_prompts)
        cached = sum(p.cached for p in first_prompts)
        first_p = {k: p for g, ps in zip(groups, first) for k, p in zip(g, ps)}
        finalists = [k for g, ps in zip(groups, first)
                     for k, _ in sorted(zip(g, ps), key=lambda x: -x[1])[:self.keep]]
        if len(finalists) > self.max_options:
            final_p, more, more_cached = self._wide(prep, question.narrowed(finalists), key, owners, request)
        else:
            row = self._sub_row(prep.state_text, question, finalists)
            final = self._prompt(key, row, self._tail(row), prep, request)
            final_p = dict(zip(finalists, self._probs([final], owners, use_graphs=False)[0]))
            more, more_cached = len(final.ids), final.cached
        chosen = set(finalists)
        rest = [k for k in keys if k not in chosen]
        mass = sum(first_p[k] for k in rest) or 1.0
        probs = {k: final_p[k] * (1 - self.residual) for k in finalists}
        probs.update({k: self.residual * first_p[k] / mass for k in rest})
        z = sum(probs.values())
        return {k: probs[k] / z for k in keys}, tokens + more, cached + more_cached

    @staticmethod
    def _answer(row: J.Row, p: list[float]):
        ids = [o.id for o in row.options]
        if row.type == "noul":
            return NoulAnswer(p[ids.index("true")])
        if row.type == "score":
            return ScoreAnswer(sum(i * v for i, v in enumerate(p)), max(p),
                               {str(i): o.label for i, o in enumerate(row.options)},
                               {str(i): v for i, v in enumerate(p)})
        return choice_answer(dict(zip(ids, p)))

    def _finish(self, prep: _Prepared, probs: list[list[float]], owners: dict) -> tuple[dict, Usage]:
        answers = dict(prep.answers)
        tokens = sum(len(p.ids) for p in prep.prompts)
        cached = sum(p.cached for p in prep.prompts)
        for prompt, p in zip(prep.prompts, probs):
            answers[prompt.key] = self._answer(prompt.row, p)
        for key, first_prompts in prep.wide.items():
            dist, n, c = self._wide(prep, prep.questions[key], key, owners, first_prompts[0].request, first_prompts)
            tokens, cached = tokens + n, cached + c
            answers[key] = choice_answer(dist)
        ordered = {k: answers[k] for k in prep.questions}
        return ordered, Usage(tokens, 0, InputTokensDetails(cached))

    # ---- public API
    def parse(self, state, questions) -> DecisionRequest:
        """A wire-format request parsed with this checkpoint's template (DecisionValidationError for a bad state
        or an empty `questions`; a bad question is kept as Invalid, for prepare to name with the others)."""
        return J.parse_request(state, questions, self.template)

    def decide_requests(self, requests: list[DecisionRequest]) -> list:
        """Parsed requests -> per request (answers, Usage) as records, or its DecisionValidationError. Requests
        that carry the same state share its prefix pass, and the tails of every request share passes as
        `passes.plan` decides. A batch of one replays a recorded graph on a GPU when one fits."""
        owners: dict = {}
        if len(requests) == 1:
            try:
                prep = self.prepare(requests[0])
            except DecisionValidationError as e:
                return [e]
            return [self._finish(prep, self._probs(prep.prompts, owners), owners)]
        preps: list = []
        for i, request in enumerate(requests):
            try:
                preps.append(self.prepare(request, i))
            except DecisionValidationError as e:
                preps.append(e)
        flat = [p for prep in preps if isinstance(prep, _Prepared) for p in prep.prompts]
        probs = self._probs(flat, owners, use_graphs=False)
        out, i = [], 0
        for prep in preps:
            if not isinstance(prep, _Prepared):
                out.append(prep)
                continue
            out.append(self._finish(prep, probs[i:i + len(prep.prompts)], owners))
            i += len(prep.prompts)
        return out

    def decide(self, state, questions: dict) -> tuple[dict, dict]:
        """One wire-format request -> (answers, usage) as System One's JSON objects. On CUDA its questions replay
        one recorded graph when one fits. DecisionValidationError names every bad question."""
        return self.decide_batch([(state, questions)], with_usage=True)[0]

    def decide_batch(self, requests: list, with_usage: bool = False, return_exceptions: bool = False) -> list:
        """[(state, questions), ...] in the wire format -> [answers, ...] (or [(answers, usage), ...] with
        `with_usage`) as System One's JSON objects. With `return_exceptions`, a bad request's slot holds its
        DecisionValidationError and the others are still answered."""
        return decide_wire(requests, self.parse, self.decide_requests, with_usage, return_exceptions)
