"""The OpenAI API's shared shapes: request bodies checked whole and field by field, errors, usage, stream
events. What one endpoint alone reads or answers is in its file (gptkit/serve/endpoints/).

Every bad request is an ApiError: an HTTP status and {"error": {"message", "type", "param", "code"}}, the
body OpenAI's own API answers with (the `openai` client raises it as BadRequestError, NotFoundError, ...).
A field of the wrong type, a value out of range, an unknown field and a feature this server does not
implement (tools, penalties, logit_bias...) each name their field in `param`; a feature's neutral value
(presence_penalty=0, tools=[]) is accepted, as clients send them by default.

A body is checked whole before any field is read (parse_body): JSON (no NaN or Infinity, no number beyond a
float's range, nested at most MAX_DEPTH levels), an object, and every string valid Unicode (a lone
surrogate such as "\ud800" is refused where it stands); each field then has its type and range, integers
within 64 bits (a seed within what torch's generators take, seed + n - 1 included).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Optional

from gptkit.inference.batcher import SEED_MAX, SEED_MIN

# how deeply a request body may nest (OpenAI's own bodies nest 4 levels: messages[i].content[j].text)
MAX_DEPTH = 64
# the longest stop string
MAX_STOP_CHARS = 1000
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# the most alternatives a token's log-probs list (top_logprobs; completions' logprobs): OpenAI's and vLLM's 20
MAX_LOGPROBS = 20


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param, code)


# ---- the body -------------------------------------------------------------------------------------------
def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is beyond a float's range")
    return v


def parse_body(raw: bytes) -> dict:
    """A request body as a dict, or a 400 (invalid_json, or the field that holds text that is not Unicode)."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise bad(
            f"the JSON body is nested too deeply to read: at most {MAX_DEPTH} levels", None, "invalid_json"
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, json.JSONDecodeError):
            why = f" at line {exc.lineno} column {exc.colno} ({exc.msg})"
        elif isinstance(exc, UnicodeDecodeError):
            why = " (it is not UTF-8)"
        elif "integer string conversion" in str(exc):
            why = f" (a number of more than {sys.get_int_max_str_digits()} digits)"
        else:
            why = f" ({(str(exc).splitlines() or [''])[0][:120]})"
        raise bad(
            f"We could not parse the JSON body of your request{why}: send a JSON object with the "
            "Content-Type application/json",
            None,
            "invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_json")
    check_text(body)
    return body


def check_text(body: dict) -> None:
    """Every key and string of the body valid Unicode (no lone surrogate), nested at most MAX_DEPTH levels;
    a 400 names where (without recursion: a body may nest as deeply as the JSON parser went)."""
    todo: list[tuple[Any, str, int]] = [(body, "", 1)]
    while todo:
        v, where, depth = todo.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise bad(
                        f"{where or 'the body'} holds {json.dumps(v[exc.start])}, a lone UTF-16 surrogate: "
                        "not text (encode it as a character, or remove it)",
                        where or None,
                        "invalid_value",
                    ) from None
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise bad(
                f"the JSON body is nested more than {MAX_DEPTH} levels deep (at {where})",
                None,
                "invalid_json",
            )
        if isinstance(v, dict):
            for key, item in v.items():
                path = f"{where}.{key}" if where else key
                todo.append((key, where, depth))
                todo.append((item, path, depth + 1))
        else:
            todo.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(v))


# ---- field checks ------------------------------------------------------------------------------------
def type_name(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array"}.get(
        type(v), "an object" if isinstance(v, dict) else "null" if v is None else type(v).__name__
    )


def integer(body: dict, key: str, *, low: Optional[int] = None, high: Optional[int] = None) -> Optional[int]:
    """body[key]: None, or an integer in low..high (a bound not given: 64-bit)."""
    v = body.get(key)
    if v is None:
        return None
    # JSON has one number type: 3.0 is 3
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{key} must be an integer, not {type_name(v)} ({json.dumps(v)[:40]})", key, "invalid_type")
    lo = INT64_MIN if low is None else low
    hi = INT64_MAX if high is None else high
    if not lo <= v <= hi:
        span = f">= {low}" if high is None and low is not None and v < low else f"between {lo} and {hi}"
        shown = str(v) if len(str(v)) <= 40 else f"{str(v)[:20]}...({len(str(v))} digits)"
        raise bad(f"{key}={shown} is out of range: it must be {span}", key, "invalid_value")
    return v


def number(body: dict, key: str, *, low: float, high: float, low_open: bool = False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"{key} must be a number, not {type_name(v)} ({json.dumps(v)[:40]})", key, "invalid_type")
    if v > high or v < low or (low_open and v == low):
        left = "(" if low_open else "["
        raise bad(f"{key}={v} is out of range: it must be in {left}{low}, {high}]", key, "invalid_value")
    return float(v)


def boolean(body: dict, key: str) -> Optional[bool]:
    v = body.get(key)
    if v is None or isinstance(v, bool):
        return v
    raise bad(f"{key} must be a boolean, not {type_name(v)}", key, "invalid_type")


def string(body: dict, key: str) -> Optional[str]:
    v = body.get(key)
    if v is None or isinstance(v, str):
        return v
    raise bad(f"{key} must be a string, not {type_name(v)}", key, "invalid_type")


def stop_strings(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or any(not isinstance(s, str) for s in items):
        raise bad("stop must be a string or an array of strings", "stop", "invalid_type")
    if any(s == "" for s in items):
        raise bad("stop strings must not be empty", "stop", "invalid_value")
    if len(items) > 16:
        raise bad(f"stop holds {len(items)} strings; at most 16", "stop", "invalid_value")
    longest = max(map(len, items), default=0)
    if longest > MAX_STOP_CHARS:
        raise bad(
            f"a stop string of {longest:,} characters is longer than the {MAX_STOP_CHARS:,} allowed",
            "stop",
            "invalid_value",
        )
    return tuple(items)


# the fields both completion endpoints know (each adds its own: gptkit/serve/endpoints/)
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    "metadata",
    "store",
    "service_tier",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
}


def unsupported(body: dict, key: str, neutral: tuple, what: str) -> None:
    """A feature this server does not implement: its neutral values pass, any other is a 400."""
    v = body.get(key)
    if v is None or any(v == n and type(v) is type(n) for n in neutral):
        return
    raise bad(f"{key}={json.dumps(v)[:60]}: {what} is not supported by gptkit serve", key, "unsupported")


def check_unknown(body: dict, known: set[str]) -> None:
    for key in body:
        if key not in known:
            raise bad(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")


@dataclass
class Sampling:
    """The sampling fields of a request, checked."""

    max_tokens: Optional[int]
    temperature: float
    top_p: float
    top_k: Optional[int]
    seed: Optional[int]
    stop: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    model: Optional[str]


def sampling(body: dict, max_n: int, max_tokens_key: str = "max_tokens") -> Sampling:
    """The fields both endpoints share (after check_unknown)."""
    model = string(body, "model")
    max_tokens = integer(body, max_tokens_key, low=1)
    if max_tokens_key != "max_tokens" and max_tokens is None:
        max_tokens = integer(body, "max_tokens", low=1)
    temperature = number(body, "temperature", low=0.0, high=2.0)
    top_p = number(body, "top_p", low=0.0, high=1.0, low_open=True)
    top_k = integer(body, "top_k", low=-1)
    n = integer(body, "n", low=1, high=max_n)
    # choice i of n draws with seed + i: torch's generators take a signed or unsigned 64-bit seed
    seed = integer(body, "seed", low=SEED_MIN, high=SEED_MAX)
    if seed is not None and seed + (n or 1) - 1 > SEED_MAX:
        raise bad(
            f"seed={seed} with n={n}: choice i draws with seed + i, and seed + n - 1 must be at most "
            f"{SEED_MAX}",
            "seed",
            "invalid_value",
        )
    stream = bool(boolean(body, "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options must be an object", "stream_options", "invalid_type")
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options", "invalid_value")
        include_usage = bool(boolean(opts, "include_usage"))
    for key in ("presence_penalty", "frequency_penalty"):
        number(body, key, low=-2.0, high=2.0)
        unsupported(body, key, (0, 0.0), "a penalty")
    if body.get("logit_bias") is not None and not isinstance(body["logit_bias"], dict):
        raise bad("logit_bias must be an object", "logit_bias", "invalid_type")
    unsupported(body, "logit_bias", ({},), "logit_bias")
    for key in ("user", "service_tier"):
        string(body, key)
    return Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=None if top_k in (None, 0, -1) else top_k,
        seed=seed,
        stop=stop_strings(body),
        n=1 if n is None else n,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=bool(boolean(body, "ignore_eos")),
        model=model,
    )


# ---- responses ------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj: Any) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
