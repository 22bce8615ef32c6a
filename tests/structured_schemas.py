"""50 JSON schemas for the structured-output tests, written programmatically.

Every schema bounds its output (strings by maxLength or a fixed pattern, arrays by maxItems,
integers by minimum/maximum, objects closed by additionalProperties false, numbers by a pattern-free
enum or an integer range), so that even a model with random weights, forced by the mask, ends in a
few dozen byte tokens: an output cut by max_new_tokens could not be valid.
"""

from __future__ import annotations


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def _short(n: int = 4) -> dict:
    return {"type": "string", "maxLength": n}


LEAVES = [
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    _short(3),
    {"type": "string", "minLength": 2, "maxLength": 3},
    {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
    {"type": "string", "pattern": "^(yes|no)$"},
    {"enum": [1, 2, 3.5, "x", None, True]},
    {"type": "integer", "minimum": 100, "maximum": 105},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    {"type": "string", "format": "date"},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
]


def schemas() -> list[dict]:
    """The 50 schemas: single leaves in an object, pairs, nested objects, arrays of objects, unions, optional fields."""
    out = []
    for i, leaf in enumerate(LEAVES):  # 17: one required field
        out.append(_obj({f"f{i}": leaf}))
    for i in range(0, 16, 2):  # 8: two fields
        out.append(_obj({"a": LEAVES[i], "b": LEAVES[i + 1]}))
    for i in range(6):  # 6: a nested object
        out.append(_obj({"id": LEAVES[0], "inner": _obj({"v": LEAVES[(i * 3) % len(LEAVES)], "w": LEAVES[2]})}))
    for i in range(4):  # 4: an array of small objects
        out.append(_obj({"items": {"type": "array", "items": _obj({"k": LEAVES[4 + i]}), "maxItems": 2}}))
    for i in range(4):  # 4: anyOf of two objects
        out.append({"anyOf": [_obj({"kind": {"const": "num"}, "n": LEAVES[i]}), _obj({"kind": {"const": "txt"},
                                                                                      "t": _short(2)})]})
    for i in range(4):  # 4: optional fields (only "req" required)
        out.append(_obj({"req": LEAVES[i], "opt": LEAVES[i + 4], "opt2": LEAVES[6]}, required=["req"]))
    for i in range(3):  # 3: arrays at the top level
        out.append({"type": "array", "items": LEAVES[[0, 4, 13][i]], "minItems": 1, "maxItems": 3})
    out += [  # 4: other shapes
        {"enum": ["alpha", "beta"]},
        _obj({"matrix": {"type": "array", "items": {"type": "array", "items": LEAVES[0], "maxItems": 2}, "maxItems": 2}}),
        _obj({"deep": _obj({"deeper": _obj({"deepest": LEAVES[2]})})}),
        {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]},
    ]
    assert len(out) == 50, len(out)
    return out
