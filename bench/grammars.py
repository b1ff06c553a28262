"""The grammar libraries side by side: llguidance (what the engine uses) and xgrammar (vLLM's default).

    pip install --target /tmp/xgr --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
    PYTHONPATH=/tmp/xgr python -m bench.grammars

xgrammar is not a dependency of the project (it needs torch, transformers and triton at install): it is
installed beside it for this comparison only. For the demo chat model's vocabulary and a random 50,257-token
one: the cost of indexing the vocabulary, of compiling a JSON schema (median of 5, each schema new to the
compiler), and of each token mask along a valid document (median, 90th percentile, max), plus which schema
keywords each refuses and which it accepts while not enforcing them.
"""
from __future__ import annotations

import json
import statistics
import time

import llguidance
import llguidance.tiktoken
import llguidance.torch as lgt

from bench.engine import random_vocab
from core.chat.checkpoint import load_chat_tokenizer
from core.chat.grammars import JSON_LAYOUT

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city"]},
    "kind": {"enum": ["a", "b", "c"]}, "score": {"type": "number"}},
    "required": ["name", "age", "tags", "kind"], "additionalProperties": False}
DOC = json.dumps({"name": "Marko Polo the traveller", "age": 42, "tags": ["sea", "silk road", "venice"],
                  "address": {"city": "Venezia", "zip": "30100"}, "kind": "b", "score": 3.25})
KEYWORDS = {"uniqueItems": {"type": "array", "uniqueItems": True}, "not": {"not": {"type": "string"}},
            "if/then": {"if": {"type": "string"}, "then": {"minLength": 2}},
            "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
            "multipleOf (number)": {"type": "number", "multipleOf": 3},
            "oneOf (overlapping)": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
            "format: bogus": {"type": "string", "format": "bogus"}}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def pct(values: list[float], q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


def main():
    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
        print("xgrammar is not installed (see this module's docstring): llguidance only")
    vocabs = [("demo-chat", load_chat_tokenizer("models/demo-chat")[0].enc), ("random 50k", random_vocab(50257).enc)]
    for name, enc in vocabs:
        V, eos = enc.n_vocab, enc.n_vocab - 1
        t0 = time.perf_counter()
        lltok = llguidance.tiktoken.lltokenizer_from_encoding(enc, eos_token=eos)
        ll_index = time.perf_counter() - t0
        tokens = lltok.tokenize_str(DOC)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_LAYOUT | {
            "whitespace_flexible": True})
        compile_ll = []
        for _ in range(5):
            t0 = time.perf_counter()
            m = llguidance.LLMatcher(lltok, grammar)
            compile_ll.append(time.perf_counter() - t0)
        bits = lgt.allocate_token_bitmask(1, V)
        mask_ll = []
        for t in tokens:
            t0 = time.perf_counter()
            lgt.fill_next_token_bitmask(m, bits, 0)
            mask_ll.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
        print(f"== {name}: {V} tokens, a document of {len(tokens)} tokens")
        print(f"llguidance: vocabulary index {ms(ll_index)}, compile {ms(statistics.median(compile_ll))}, mask median "
              f"{statistics.median(mask_ll) * 1e6:.0f} us, p90 {pct(mask_ll, 0.9) * 1e6:.0f} us, "
              f"max {max(mask_ll) * 1e6:.0f} us")
        if xgr is None:
            continue
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo([enc.decode_single_token_bytes(i) for i in range(V)], xgr.VocabType.RAW,
                                 vocab_size=V, stop_token_ids=[eos])
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        xg_index = time.perf_counter() - t0
        compile_xg = []
        for i in range(5):
            t0 = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(dict(SCHEMA, title=f"t{i}")))   # new to its cache
            compile_xg.append(time.perf_counter() - t0)
        matcher, xbits, mask_xg = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, V), []
        for t in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(xbits, 0)
            mask_xg.append(time.perf_counter() - t0)
            assert matcher.accept_token(t)
        print(f"xgrammar:   vocabulary index {ms(xg_index)}, compile {ms(statistics.median(compile_xg))}, mask median "
              f"{statistics.median(mask_xg) * 1e6:.0f} us, p90 {pct(mask_xg, 0.9) * 1e6:.0f} us, "
              f"max {max(mask_xg) * 1e6:.0f} us")
    print("== keywords: llguidance | xgrammar")
    for name, schema in KEYWORDS.items():
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_json_schema(schema))
        ll = "refused" if is_error or messages else "accepted"
        xg = "-"
        if xgr is not None:
            try:
                xgr.GrammarCompiler(xgr.TokenizerInfo([bytes([b]) for b in range(256)])).compile_json_schema(
                    json.dumps(schema))
                xg = "accepted"
            except Exception:      # noqa: BLE001 - any refusal counts
                xg = "refused"
        print(f"{name:22} {ll:9} | {xg}")


if __name__ == "__main__":
    main()
