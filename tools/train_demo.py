"""Train the embedded demo models on CPU from synthetic data, reproducibly from a fixed seed.

    python -m tools.train_demo chat [--out models/demo-chat] [--steps N]
    python -m tools.train_demo decision [--out models/demo-decision] [--steps N]

chat: a rustbpe tokenizer (~2k tokens, SPLITS["words"]) and a small nanochat-architecture model trained on
generated conversations (greetings, capitals of 50 countries, arithmetic through the calculator, follow-ups,
then tools and JSON), in the phases of CHAT_PHASES, with the loss on the assistant's own tokens only (not the
user's, not the calculator's forced output).
decision: a `tokenizers` BPE and a small Qwen3.5 hybrid (three Gated DeltaNet and three full-attention
layers) trained on generated jevfmt questions, with the loss on the answer letter plus a next-token loss on
the prompt, in the phases of DECISION_PHASES (docs/demo-models.md). Weights are saved in bf16.
"""
from __future__ import annotations

import argparse
import logging
import math
import random
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from core.chat import ChatDefaults, ChatModelConfig, ChatPrompter, build_model, load_chat_model, save_chat_model
from core.chat.protocol import ToolFormat
from core.chat.grammars import tools_text
from core.chat.model import init_weights
from core.chat.nanochat_versions import FP32_EPS
from core.chat.tokenizer import train_tokenizer
from tools import demo_data as D

logger = logging.getLogger("train_demo")

FEWSHOT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hello! How can I help you today?"}]


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def optimizer_step(opt, model, loss, step: int, steps: int, peak: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr_at(step, steps, peak)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def render_training(prompter: ChatPrompter, msgs: list[dict], tools: list[dict] | None = None
                    ) -> tuple[list[int], list[int]]:
    """ids of prefix + conversation, and a mask of the tokens the model must learn to produce. With `tools`,
    the first user turn starts with their description, as the service's prompt shows it (grammars.tools_text)."""
    tok = prompter.tok
    forced = {tok.encode_special("<|output_start|>"), tok.encode_special("<|output_end|>")}
    ids, mask = list(prompter.prefix_ids), [0] * len(prompter.prefix_ids)
    system = tools_text(tools, prompter.tool_format) if tools else ""
    called = {c["id"]: c["function"]["name"] for m in msgs for c in m.get("tool_calls") or ()}
    for i, m in enumerate(msgs):
        turn = prompter._turn(m, f"messages[{i}]", system if i == 0 else "", called)
        if m["role"] in ("user", "tool"):
            ids += turn
            mask += [0] * len(turn)
            continue
        inside_output = False
        forced_bytes, seen = len(m.get("forced", "").encode()), 0     # a text the grammar writes: no loss
        for j, t in enumerate(turn):
            if j > 0:
                seen += len(tok.token_bytes(t))
            learn = j > 0 and not inside_output and t not in forced and (not forced_bytes or seen > forced_bytes)
            if t == tok.encode_special("<|output_start|>"):
                inside_output = True
            elif t == tok.encode_special("<|output_end|>"):
                inside_output = False
            ids.append(t)
            mask.append(1 if learn else 0)
    return ids, mask


def chat_example(rng: random.Random, tools_share: float, keys_share: float = 0.0
                 ) -> tuple[list[dict], list[dict] | None]:
    """One training conversation and the tools it offers (None): with probability `keys_share` a JSON reply
    with the keys its request names (D.any_json_conversation); else with probability `tools_share` a tool
    conversation (D.tool_conversation), with a quarter of that a JSON reply and another quarter a JSON object
    as a named function's arguments, else phase 1's conversations."""
    if keys_share and rng.random() < keys_share:
        return D.any_json_conversation(rng), None
    u = rng.random()
    if u < tools_share:
        tools, msgs, _ = D.tool_conversation(rng)
        return msgs, tools
    if u < 1.25 * tools_share:
        return D.json_conversation(rng), None
    if u < 1.5 * tools_share:
        tools, msgs = D.json_call_conversation(rng)
        return msgs, tools
    return D.conversation(rng)[0], None


def chat_phase(model, prompter, rng, steps: int, peak: float, tools_share: float, keys_share: float = 0.0,
               batch: int = 32) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.time()
    for step in range(steps):
        # batches cut from a pool sorted by length, so that a short conversation is not padded to a tool one's
        pool = sorted((render_training(prompter, *chat_example(rng, tools_share, keys_share))
                       for _ in range(batch * POOL)), key=lambda x: len(x[0]))
        for k in range(POOL):
            seqs = pool[k * batch:(k + 1) * batch]
            T = max(len(s) for s, _ in seqs)
            ids = torch.zeros(batch, T, dtype=torch.long)
            mask = torch.zeros(batch, T)
            for b, (s, m) in enumerate(seqs):
                ids[b, :len(s)], mask[b, :len(m)] = torch.tensor(s), torch.tensor(m, dtype=torch.float)
            logits = model(ids[:, :-1])
            loss_all = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                       reduction="none")
            loss = (loss_all * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
            optimizer_step(opt, model, loss, step * POOL + k, steps * POOL, peak)
        if step % 20 == 0 or step == steps - 1:
            logger.info("chat step %d/%d loss %.4f (%.0fs)", (step + 1) * POOL, steps * POOL, loss.item(),
                        time.time() - t0)


# Split patterns of the chat tokenizer. GPT-4's (rustbpe's default and demo-gpt2's tokenizer's; nanochat's
# differs only in grouping digits by two) lets a word take the character before it, so a word in prose (" town":
# ` t`, `ow`, `n`) and the same word as a JSON key (`{"town"`: `t`, `ow`, `n`) or at the start of a tool's result
# are different tokens, and copying it means spelling it anew. "words" keeps a space out of the word after it (a
# space is a token of its own): prose and JSON keys tokenize a word the same, for about a quarter more tokens a
# conversation; demo-chat's tokenizer (docs/demo-models.md has the probe that compared them and what it bought).
SPLITS = {"gpt4": None,
          "words": (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N} ]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                    r"""|\s*[\r\n]|\s+(?!\S)|\s+""")}


# Chat training runs in phases: the first learns the conversations (greetings, capitals, the calculator); the
# second adds tool calls in the checkpoint's format and JSON replies, with the first phase's conversations still in
# the mix so that they are not forgotten. A phase's keys_share adds JSON replies with the keys their request names
# (docs/demo-models.md has the shares measured).
class ChatPhase(NamedTuple):
    steps: int
    peak_lr: float
    tools_share: float            # tool conversations, and JSON at half of this (chat_example)
    keys_share: float = 0.0       # JSON replies with the keys the request names, before the rest


# The demo chat model's recipe (models/demo-chat, with SPLITS["words"]): four in ten of the second phase's
# conversations are JSON replies with the keys their request names. demo-gpt2 keeps the recipe it was trained with
# (GPT-4's split, no keys share: GPT2_CHAT_PHASES).
CHAT_PHASES = [ChatPhase(4800, 3e-3, 0.0), ChatPhase(4800, 1e-3, 0.5, 0.4)]
GPT2_CHAT_PHASES = [ChatPhase(4800, 3e-3, 0.0), ChatPhase(4800, 1e-3, 0.5)]
DEFAULT_PHASES = {"nanochat": CHAT_PHASES, "gpt2": GPT2_CHAT_PHASES}
DEFAULT_SPLIT = {"nanochat": "words", "gpt2": "gpt4"}


def train_chat(out: str, phases: list[ChatPhase] | None = None, seed: int = 0, resume: str | None = None,
               first_phase: str | None = None, arch: str = "nanochat", layers: int = 4, width: int = 128,
               heads: int = 4, resume_phase: int = 1, split: str | None = None) -> None:
    """Train from scratch, or with `resume` (a checkpoint of the phases before `resume_phase`) only the phases
    from `resume_phase` on it; `first_phase`: where to save the model after the first phase too (for a later
    `resume`). arch "gpt2": a GPT-2-architecture model of 2 x 128 instead (the second chat model of
    serve_config.models.yaml).
    `layers`, `width`, `heads`: the nanochat model's size (4 x 128 with 4 heads: the committed demo model);
    `phases`: default DEFAULT_PHASES[arch]; `split`: the tokenizer's split pattern, a key of SPLITS (default
    DEFAULT_SPLIT[arch]; a resumed run keeps its checkpoint's tokenizer)."""
    phases = DEFAULT_PHASES[arch] if phases is None else phases
    torch.manual_seed(seed)
    fmt = ToolFormat(**D.TOOL_FORMAT)
    first = 0
    if resume:
        model, tok, cfg = load_chat_model(resume, device="cpu")
        model = model.float().train()
        first = resume_phase
    else:
        tok = train_tokenizer(D.chat_corpus_text(seed=seed), 2048, SPLITS[split or DEFAULT_SPLIT[arch]])
        if arch == "gpt2":
            cfg = ChatModelConfig(arch="gpt2", vocab_size=tok.vocab_size, n_layer=2, n_head=4, n_kv_head=4,
                                  n_embd=128, sequence_len=512, gelu_approximate="tanh")
        else:   # nanochat's current architecture (nanochat_versions.py's newest version), 4 x 128 by default
            cfg = ChatModelConfig(arch="nanochat", vocab_size=tok.vocab_size, n_layer=layers, n_head=heads,
                                  n_kv_head=heads, n_embd=width, sequence_len=512, rms_norm_eps=FP32_EPS,
                                  rope_theta=100000.0, qk_scale=1.2, window_pattern="SSSL", short_window=128,
                                  residual_lambdas=True, value_embeds=True, smear=True, backout=True)
        model = init_weights(build_model(cfg), seed=seed, std=0.02).train()
    prompter = ChatPrompter(tok, cfg.sequence_len, FEWSHOT, fmt)
    defaults = ChatDefaults(fewshot=FEWSHOT, temperature=0.0, top_k=None, top_p=1.0, max_tokens=64,
                            tool_call=dict(D.TOOL_FORMAT))
    for i, phase in enumerate(phases[first:], start=first):
        if i == max(first, 1):   # the later phases' made-up words use the tokenizer's pieces (phase 1 has none)
            D.use_vocabulary(tok)
        # each phase draws its examples from its own seed, so a resumed run sees the data a whole run sees
        chat_phase(model, prompter, random.Random(seed + 1000 * i), max(1, phase.steps // POOL), phase.peak_lr,
                   phase.tools_share, phase.keys_share)
        if i == 0 and first_phase:
            save_chat_model(first_phase, model.eval(), tok, defaults, dtype=torch.bfloat16)
            model.train()
    save_chat_model(out, model.eval(), tok, defaults, dtype=torch.bfloat16)


# Decision training runs in phases of (steps, peak learning rate, task weights, score levels in serving order).
# The first phase learns all four kinds together; counting ("how many are a fruit") comes last and gets a phase
# of its own, where half of the questions are score questions shown as the scorer shows them, and the rest
# keep the other kinds from being forgotten.
class Phase(NamedTuple):
    steps: int
    peak_lr: float
    weights: dict | None          # task weights; None: uniform
    serve_order: bool             # score levels in the order the scorer shows them
    aux: dict                     # shares of the training-only tasks (D.AUX_TASKS)


AUX = {"choice_category_name": 0.1, "score_category_name": 0.1}
DECISION_PHASES = [Phase(4000, 1e-3, None, False, AUX),
                   Phase(1000, 5e-4, {"choice_category": 1, "choice_largest": 0.5, "noul": 0.5, "score": 2}, True, AUX)]
POOL = 8   # batches drawn at once and cut by prompt length, so that a batch carries little padding


def decision_phase(model, tok, rng, phase: Phase, batch: int = 32) -> None:
    """One phase. Options are shown in a random order, so the model reads them rather than their position;
    with `serve_order`, score levels keep the order the scorer always shows them in (0, 1, 2, ...)."""
    from core.decision import jevfmt as J

    letters = J.letter_token_ids(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=phase.peak_lr, betas=(0.9, 0.95), weight_decay=0.0)

    def example():
        _, state, q, truth = D.decision_example(rng, knowledge=True, aux=phase.aux, weights=phase.weights)
        row = J.from_systemone(state, q)
        order = [o.id for o in row.options]
        if not (phase.serve_order and q.get("type") == "score"):
            rng.shuffle(order)
        return J.render_ids(row, tok, order, 4096)[0], letters[order.index(truth)]

    ready: list = []
    t0 = time.time()
    for step in range(phase.steps):
        if not ready:   # lengths vary ~3x (filler, knowledge): sorting cuts the positions a step computes by ~30%
            pool = sorted((example() for _ in range(batch * POOL)), key=lambda e: len(e[0]))
            ready = [pool[i:i + batch] for i in range(0, len(pool), batch)]
            rng.shuffle(ready)
        prompts, targets = zip(*ready.pop())
        T = max(len(p) for p in prompts)
        ids = torch.full((batch, T), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros(batch, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, :len(p)], attn[b, :len(p)] = torch.tensor(p), 1
        hidden = model.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        logits = model.lm_head(hidden)
        answer = F.cross_entropy(logits[torch.arange(batch), attn.sum(1) - 1], torch.tensor(targets))
        # next-token loss on the prompt too: far more signal per example, and it teaches the option layout
        lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
        lm = (lm * attn[:, 1:].reshape(-1)).sum() / attn[:, 1:].sum()
        loss = answer + 0.5 * lm
        optimizer_step(opt, model, loss, step, phase.steps, phase.peak_lr)
        if step % 100 == 0 or step == phase.steps - 1:
            logger.info("decision step %d/%d answer loss %.4f lm loss %.4f (%.0fs)", step, phase.steps,
                        answer.item(), lm.item(), time.time() - t0)


def train_decision(out: str, phases=DECISION_PHASES, seed: int = 0) -> None:
    from core.decision.build import (hybrid_text_config, new_hybrid_model, save_decision_checkpoint,
                                          train_decision_tokenizer)

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = train_decision_tokenizer(D.decision_corpus_text(seed=seed), 1024)
    # three Gated DeltaNet and three full-attention layers: a category question takes three hops (the question's
    # word to the answer position, the matching option, its letter); with two attention layers it never learned
    cfg = hybrid_text_config(len(tok), hidden=128, layers=6, heads=4, full_every=2, pad_token_id=tok.pad_token_id)
    model = new_hybrid_model(cfg, seed=seed).train()
    for phase in phases:
        decision_phase(model, tok, rng, phase)
    # it saw at most six options per question (D.choice_category) and is surest with fewer: on questions not
    # in the tests (other seeds), rounds of at most five beat one pass over six (56/56 against 47/56 right)
    # and rounds of six on 40 options (39/40 against 30/40)
    save_decision_checkpoint(out, model.eval().to(torch.bfloat16), tok,
                             temperature_by_type={"choice": 1.0, "noul": 1.0, "score": 1.0},
                             wide_choice={"group": 5, "keep": 2, "residual": 1e-3, "max_options": 5})


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.train_demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=("chat", "decision"))
    p.add_argument("--out")
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", help="chat: a checkpoint of the phases before --resume-phase; only the phases from "
                   "there run on it")
    p.add_argument("--resume-phase", type=int, default=1,
                   help="chat, with --resume: the first phase to run (phases count from 0; default 1)")
    p.add_argument("--first-phase", help="chat: also save the model after the first phase here")
    p.add_argument("--arch", choices=("nanochat", "gpt2"), default="nanochat",
                   help="chat: the architecture (gpt2: 2 x 128, for serve_config.models.yaml's second chat model)")
    p.add_argument("--phase-steps", help="chat: each phase's steps, comma-separated (instead of --steps)")
    p.add_argument("--size", help="chat, nanochat: LAYERSxWIDTHxHEADS of a model from scratch (default 4x128x4)")
    p.add_argument("--split", choices=tuple(SPLITS),
                   help="chat: the tokenizer's split pattern for a run from scratch (SPLITS; default words for "
                   "nanochat, gpt4 for gpt2)")
    args = p.parse_args()
    if args.size and (args.which != "chat" or args.arch != "nanochat" or args.resume):
        p.error("--size sizes a nanochat chat model trained from scratch (not with --arch gpt2 or --resume)")
    if args.split and (args.which != "chat" or args.resume):
        p.error("--split chooses the tokenizer of a chat model trained from scratch (not with --resume)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.which == "chat":
        phases = DEFAULT_PHASES[args.arch]
        if args.steps:   # scale every phase to the given total
            total = sum(phase.steps for phase in phases)
            phases = [phase._replace(steps=max(1, phase.steps * args.steps // total)) for phase in phases]
        if args.phase_steps:
            phases = [phase._replace(steps=int(n)) for n, phase in zip(args.phase_steps.split(","), phases,
                                                                        strict=True)]
        train_chat(args.out or ("models/demo-chat" if args.arch == "nanochat" else "models/demo-gpt2"), phases,
                   args.seed, args.resume, args.first_phase, args.arch,
                   *map(int, (args.size or "4x128x4").split("x")), resume_phase=args.resume_phase, split=args.split)
    else:
        phases = DECISION_PHASES
        if args.steps:   # scale every phase to the given total
            total = sum(phase.steps for phase in phases)
            phases = [phase._replace(steps=max(1, phase.steps * args.steps // total)) for phase in phases]
        train_decision(args.out or "models/demo-decision", phases, args.seed)



if __name__ == "__main__":
    main()
