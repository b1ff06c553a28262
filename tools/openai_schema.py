"""Extract the schemas the tests validate against from OpenAI's published OpenAPI document.

    python -m tools.openai_schema /path/to/openai-openapi/openapi.json [--commit SHA]

Writes tests/openai_schema/schemas.json: `components.schemas` reachable (through `$ref`) from ROOTS, with a
`source` line naming the document. The document is MIT-licensed (tests/openai_schema/LICENSE).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOTS = ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse",
         "ListModelsResponse", "Model", "Response", "ResponseStreamEvent")
OUT = Path(__file__).resolve().parent.parent / "tests" / "openai_schema" / "schemas.json"
PREFIX = "#/components/schemas/"


def reachable(schemas: dict, roots) -> set[str]:
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        nodes = [schemas[name]]
        while nodes:
            node = nodes.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith(PREFIX):
                    stack.append(ref[len(PREFIX):])
                nodes.extend(v for k, v in node.items() if k != "$ref")
            elif isinstance(node, list):
                nodes.extend(node)
    return seen


def main():
    p = argparse.ArgumentParser()
    p.add_argument("openapi")
    p.add_argument("--commit", default="f85dbe2")
    args = p.parse_args()
    doc = json.loads(Path(args.openapi).read_text())
    schemas = doc["components"]["schemas"]
    names = sorted(reachable(schemas, ROOTS))
    OUT.write_text(json.dumps({
        "source": f"openai/openai-openapi openapi.json (commit {args.commit}), components.schemas reachable from "
                  + ", ".join(ROOTS),
        "openapi": doc["openapi"], "components": {"schemas": {n: schemas[n] for n in names}}}, indent=None))
    print(f"{len(names)} schemas -> {OUT}")


if __name__ == "__main__":
    main()
