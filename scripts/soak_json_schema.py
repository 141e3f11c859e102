"""Soundness soak of the JSON-schema converter: random schemas, random instances, ``jsonschema`` as the oracle.

The schemas come from the generator of ``tests/test_json_schema.py`` (``_random_new_keyword_schema``: the keywords
converted as unions of merges -- ``if`` / ``then`` / ``else``, dependencies, ``contains`` / ``maxContains``,
``not`` of types, bounds, names and string keywords, overlapping ``oneOf``, ``propertyNames`` -- nested in
objects and arrays); per seed 300 schemas, per converted schema 100 random values serialized in fst's key order
(``bench_json_schema_suite.order_instance``). Every value the regex accepts must be valid; the run stops at the
first one that is not and prints it. The test suite runs one seed of it; this script runs many.

Usage: ``python scripts/soak_json_schema.py FIRST_SEED END_SEED`` (prints: schemas, converted, accepted values).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import test_json_schema as t  # noqa: E402  (the generator and the oracle of the tests)

from scripts.bench_json_schema_suite import order_instance  # noqa: E402


def main(first: int, end: int) -> int:
    total = converted = accepted = 0
    for seed in range(first, end):
        rnd = random.Random(seed)
        for _ in range(300):
            schema = t._random_new_keyword_schema(rnd)
            total += 1
            try:
                rx = t.json_schema_to_regex(schema)
            except t.NAMED:
                continue
            converted += 1
            c = re.compile(rx)
            for _ in range(100):
                text = t.compact(order_instance(t._random_value(rnd), schema))
                if c.fullmatch(text):
                    accepted += 1
                    if not t.is_valid_text(schema, text):
                        print("UNSOUND", json.dumps(schema), text)
                        return 1
    print(f"schemas {total}, converted {converted}, accepted values {accepted}, all valid")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
