"""Tool calls in the chat API: the grammar that forces them, and the parsers that find them in text.

``tool_choice`` "required" or a named function constrains the output to the calls' JSON (structured
output), so it parses by construction; "auto" lets the model choose, and a parser for the model's own
format (``--tool-call-parser``) takes the calls out of the streamed text. Every parser is fed the answer
as it streams and returns (content, calls): calls in the shape of streamed ``delta.tool_calls`` entries,
which the non-streamed answer joins by index. Text that looked like a call but does not parse stays
content, so nothing the model wrote is lost. JSON is read with ``strict=False``: models and grammars write
control characters raw inside strings.
"""

from __future__ import annotations

import ast
import json
import re
import uuid

from pagedserve.reasoning import partial_tail

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def forced_schema(tools: list[dict], name: str | None, parallel: bool) -> dict:
    """The JSON schema of a forced choice: the named function's arguments, or ("required") a list of
    one or more calls of any of the tools."""
    if name is not None:
        return next(t["parameters"] or EMPTY_PARAMETERS for t in tools if t["name"] == name)
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                               "parameters": t["parameters"] or EMPTY_PARAMETERS},
              "required": ["name", "parameters"]} for t in tools]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolCallParser:
    """Base: numbers the calls, gives them ids, and holds the content's trailing whitespace (the blank
    lines a model writes around its calls are not an answer)."""

    keeps_special_tokens = False  # True: the format's markers are special tokens, which the text must keep

    def __init__(self):
        self.calls = 0
        self.space = ""

    def call(self, name: str, arguments: str) -> dict:
        self.calls += 1
        return {"index": self.calls - 1, "id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def text(self, text: str) -> str:
        text = self.space + text
        kept = text.rstrip()
        self.space = text[len(kept):]
        return kept

    def rest(self) -> str:
        """The whitespace still held at the end: content only if the answer made no call."""
        rest, self.space = self.space, ""
        return "" if self.calls else rest


_JSON_STRING = r'"(?:[^"\\]|\\.)*"'

# how a Hermes call opens, up to its arguments' object or array: from there they can be streamed; a block
# whose first HEAD_LIMIT characters hold no such head is judged whole at its end (the search is not
# repeated over an ever longer text, token after token)
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*(' + _JSON_STRING + r')\s*,\s*"arguments"\s*:\s*(?=[\[{])')
HEAD_LIMIT = 512


class _JsonExtent:
    """Where a JSON object or array that starts at ``pos`` of a growing text ends: strings, escapes and
    nesting are followed a character at a time, each character once."""

    def __init__(self, pos: int):
        self.pos, self.depth, self.in_string, self.escape, self.end = pos, 0, False, False, None

    def reach(self, text: str) -> int:
        """How far the value runs in ``text`` so far (to its closing bracket once it has one)."""
        i = self.pos
        while self.end is None and i < len(text):
            c = text[i]
            if self.in_string:
                self.escape, self.in_string = (False, True) if self.escape else (c == "\\", c != '"')
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
            i += 1
        self.pos = i
        return i if self.end is None else self.end


class _StreamedArguments(ToolCallParser):
    """Base of the formats whose calls go out as they are written: a call is announced once its name is
    known, then its arguments' raw JSON follows piece by piece, to its closing bracket."""

    def __init__(self):
        super().__init__()
        self.buf = ""
        self.args: _JsonExtent | None = None  # the open call's arguments
        self.sent = 0                          # ... sent up to here in ``buf``

    def _open(self, name: str, start: int) -> dict:
        """Announce a call whose arguments begin at ``start`` of ``buf``."""
        self.args, self.sent = _JsonExtent(start), start
        return self.call(name, "")

    def _arguments_until(self, upto: int) -> list[dict]:
        """The open call's arguments written since its last piece, up to ``upto`` of ``buf``."""
        reach = min(self.args.reach(self.buf), upto)
        if reach <= self.sent:
            return []
        piece, self.sent = self.buf[self.sent:reach], reach
        return [{"index": self.calls - 1, "function": {"arguments": piece}}]


class HermesParser(_StreamedArguments):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among the text (Qwen2.5, Qwen3,
    Hermes). A block that opens that way is announced as its call as soon as the arguments begin, and
    they go out as they are written (their raw JSON, to the object's closing brace); any other block is
    judged once it closes: a call if it parses, else content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.inside = False

    def _block(self, block: str, closed: bool) -> tuple[str, list[dict]]:
        try:
            obj = json.loads(block, strict=False)
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                args = obj.get("arguments", obj.get("parameters", {}))
                self.space = ""  # the blank lines before a call
                return "", [self.call(obj["name"], _arguments(args))]
        except json.JSONDecodeError:
            pass
        return self.text(self.OPEN + block + (self.CLOSE if closed else "")), []

    def _stream(self, upto: int) -> list[dict]:
        """The open block's call once its head is written, then its arguments' new text up to ``upto``."""
        calls = []
        if self.args is None:
            head = _HERMES_HEAD.match(self.buf, 0, min(upto, HEAD_LIMIT))
            if head is None:
                return []
            self.space = ""  # the blank lines before a call
            calls.append(self._open(json.loads(head.group(1), strict=False), head.end()))
        return calls + self._arguments_until(upto)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        content, calls = "", []
        while True:
            if not self.inside:
                at = self.buf.find(self.OPEN)
                if at < 0:
                    keep = partial_tail(self.buf, self.OPEN)
                    content += self.text(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return content, calls
                content += self.text(self.buf[:at])
                self.buf, self.inside = self.buf[at + len(self.OPEN):], True
            at = self.buf.find(self.CLOSE)
            if at < 0:
                return content, calls + self._stream(len(self.buf) - partial_tail(self.buf, self.CLOSE))
            if self.args is not None or _HERMES_HEAD.match(self.buf, 0, min(at, HEAD_LIMIT)):
                calls += self._stream(at)
            else:
                c, found = self._block(self.buf[:at], closed=True)
                content, calls = content + c, calls + found
            self.buf, self.inside, self.args = self.buf[at + len(self.CLOSE):], False, None

    def finish(self) -> tuple[str, list[dict]]:
        """A block the output left open (cut by max_tokens, or the model stopped before closing it): a
        streamed call keeps the arguments it got; another is a call if what it holds parses, else content."""
        content, calls = "", []
        if self.inside and (self.args is not None or _HERMES_HEAD.match(self.buf, 0, HEAD_LIMIT)):
            calls = self._stream(len(self.buf))
        elif self.inside:
            content, calls = self._block(self.buf, closed=False)
        else:
            content = self.text(self.buf)
        self.buf, self.inside, self.args = "", False, None
        return content + self.rest(), calls


class _NameFirstCalls(_StreamedArguments):
    """Formats whose calls run one after another, each a head that names the function and then its arguments
    (JSON): a call is announced as its arguments begin, and they go out as written (their raw JSON, to the
    closing bracket). From the first call that does not open that way (say, its name after its arguments)
    the rest is judged at the end: calls if ``whole`` reads it so, else content."""

    HEAD: re.Pattern   # a call's opening up to its arguments, naming it in ``json_name`` or ``bare_name``
    SEPARATORS: str    # what may stand between and after calls

    def __init__(self):
        super().__init__()
        self.pos = 0                           # where the next call may open in ``buf``
        self.closer: re.Pattern | None = None  # what ends the open call after its arguments

    def _stream(self) -> list[dict]:
        """Each call whose head is written, then its arguments' new text; on past a call once it ends."""
        calls = []
        while True:
            if self.args is None:
                head = self.HEAD.match(self.buf, self.pos, min(len(self.buf), self.pos + HEAD_LIMIT))
                if head is None:
                    return calls
                named = head.groupdict()
                json_name = named.get("json_name")
                self.closer = _OBJECT_CLOSE if json_name is not None else _NOTHING  # a {"name": ...} ends in }
                name = named["bare_name"] if json_name is None else json.loads(json_name, strict=False)
                calls.append(self._open(name, head.end()))
            calls += self._arguments_until(len(self.buf))
            end = None if self.args.end is None else self.closer.match(self.buf, self.args.end)
            if end is None:
                return calls
            self.pos, self.args = end.end(), None

    def whole(self, text: str) -> list[tuple[str, str]]:
        """The (name, arguments) of the calls ``text`` holds, read at once; ValueError or KeyError or
        TypeError if it holds something else."""
        raise NotImplementedError

    def _finish_calls(self) -> tuple[str, list[dict]]:
        """What no streamed call took: calls if ``whole`` reads it so, else content (a call cut short keeps
        the arguments it got, as its stream already said)."""
        held, self.buf = (self.buf[self.pos:] if self.calls else self.buf), ""
        if self.args is not None or (self.calls and not held.strip(self.SEPARATORS)):
            return "", []
        try:
            found = self.whole(held)
            if not found:
                raise ValueError("no call")
        except (ValueError, KeyError, TypeError):  # JSONDecodeError is a ValueError
            return self.text(held) + self.rest(), []
        self.space = ""
        return "", [self.call(name, args) for name, args in found]


_OBJECT_CLOSE, _NOTHING = re.compile(r"\s*\}"), re.compile("")


class Llama3JsonParser(_NameFirstCalls):
    """Llama 3.1+ JSON calls: an answer that opens with ``{`` (or ``<|python_tag|>``) is one or more
    ``{"name": ..., "parameters": {...}}`` objects separated by ``;``; any other answer streams as content."""

    TAG = "<|python_tag|>"
    HEAD = re.compile(r'[\s;]*\{\s*"name"\s*:\s*(?P<json_name>' + _JSON_STRING +
                      r')\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=[\[{])')
    SEPARATORS = " \t\r\n;"

    def __init__(self):
        super().__init__()
        self.mode = "lead"

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.mode == "lead":
            self.buf += text
            head = self.buf.lstrip()
            if not head or (len(head) < len(self.TAG) and self.TAG.startswith(head)):
                return "", []
            self.mode = "calls" if head.startswith(("{", self.TAG)) else "text"
            if self.mode == "calls":
                self.pos = len(self.buf) - len(head) + (len(self.TAG) if head.startswith(self.TAG) else 0)
                return "", self._stream()
            text, self.buf = self.buf, ""
        elif self.mode == "calls":
            self.buf += text
            return "", self._stream()
        return self.text(text), []

    def whole(self, text: str) -> list[tuple[str, str]]:
        source, found, pos = text.strip().removeprefix(self.TAG), [], 0
        decoder = json.JSONDecoder(strict=False)
        while True:
            while pos < len(source) and source[pos] in self.SEPARATORS:
                pos += 1
            if pos == len(source):
                return found
            obj, pos = decoder.raw_decode(source, pos)
            found.append((obj["name"], _arguments(obj.get("parameters", obj.get("arguments", {})))))
            if not isinstance(found[-1][0], str):
                raise TypeError("a call's name is a string")

    def finish(self) -> tuple[str, list[dict]]:
        if self.mode != "calls":
            held, self.buf = self.buf, ""
            return self.text(held) + self.rest(), []
        return self._finish_calls()


class PythonicParser(ToolCallParser):
    """Python-call lists (Llama 3.2, Llama 4; vLLM's ``pythonic``): an answer that opens with ``[`` is a list
    ``[name(arg=value, ...), ...]`` whose values are Python literals, which become JSON arguments. Each call
    goes out once its closing parenthesis is written; from the first item that is not such a call, the rest
    is content, as is any other answer."""

    def __init__(self):
        super().__init__()
        self.buf, self.mode = "", "lead"
        self.scan = 0           # characters of ``buf`` walked
        self.depth = 0          # brackets open at ``scan``
        self.quote = ""         # the string ``scan`` is in ('', or its quote: ', ", ''' or """)
        self.escape = False
        self.item = 0           # where the list's current item starts

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.mode == "text":
            return self.text(text), []
        self.buf += text
        if self.mode == "lead":
            head = self.buf.lstrip()
            if not head:
                return "", []
            if not head.startswith("["):
                self.mode, text, self.buf = "text", self.buf, ""
                return self.text(text), []
            self.mode, self.scan = "calls", len(self.buf) - len(head)
            self.item = self.scan + 1
        return "", self._walk() if self.mode == "calls" else []

    def _walk(self) -> list[dict]:
        """The calls completed by the characters not walked yet."""
        calls, buf, i = [], self.buf, self.scan
        while i < len(buf) and self.mode == "calls":
            c = buf[i]
            if self.quote:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif buf.startswith(self.quote, i):
                    i += len(self.quote) - 1
                    self.quote = ""
                elif len(buf) - i < len(self.quote) and self.quote.startswith(buf[i:]):
                    break  # perhaps a closing triple quote, not all written yet
            elif c in "'\"":
                if buf.startswith(c * 3, i):
                    self.quote, i = c * 3, i + 2
                elif i + 2 < len(buf) or buf[i + 1:i + 2] not in ("", c):
                    self.quote = c
                else:  # one or two quotes at the end: wait to see whether a triple quote opens here
                    break
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth -= 1
                if (self.depth == 1 and c == ")") or self.depth == 0:  # a call closed, or the list
                    call = _python_call(buf[self.item:i + 1 if c == ")" else i])
                    if call is None and (c == ")" or buf[self.item:i].strip()):
                        self.mode = "rest"  # not a call: from this item on, the text is content
                        break
                    if call is not None:
                        calls.append(self.call(*call))
                    self.item = i + 1
                    self.mode = "calls" if self.depth else "closed"
            elif self.depth == 1 and c == "," and not buf[self.item:i].strip():
                self.item = i + 1  # the comma after a call
            i += 1
        self.scan = i
        return calls

    def finish(self) -> tuple[str, list[dict]]:
        held, self.buf = self.buf, ""
        if self.mode in ("lead", "text") or not self.calls:
            return self.text(held) + self.rest(), []
        rest = held[self.item:]
        return ("" if self.mode == "closed" and not rest.strip() else self.text(rest) + self.rest()), []


def _python_call(text: str) -> tuple[str, str] | None:
    """("name", JSON arguments) of ``name(key=literal, ...)``; None for anything else."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return None
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        if None in args:
            return None  # **kwargs
        return node.func.id, json.dumps(args, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


class NamedCallParser(ToolCallParser):
    """tool_choice naming a function: the whole output is its arguments (the grammar saw to that), streamed
    as they come."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if not text:
            return "", []
        if not self.calls:
            return "", [self.call(self.name, text)]
        return "", [{"index": 0, "function": {"arguments": text}}]

    def finish(self) -> tuple[str, list[dict]]:
        return "", []


class RequiredCallsParser(ToolCallParser):
    """tool_choice "required": the output is a JSON list of {"name", "parameters"} (the grammar saw to
    that), parsed once it is complete; cut short by max_tokens, it is returned as content."""

    def __init__(self):
        super().__init__()
        self.buf = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        held, self.buf = self.buf, ""
        try:
            items = json.loads(held, strict=False)
            return "", [self.call(item["name"], _arguments(item["parameters"])) for item in items]
        except (json.JSONDecodeError, KeyError, TypeError):
            return held, []


class MistralParser(_NameFirstCalls):
    """Mistral's calls, after its ``[TOOL_CALLS]`` marker: a JSON list of {"name", "arguments"} (v3
    tokenizers: Mistral-7B-Instruct-v0.3, Nemo, Small) or ``name[ARGS]{...}`` per call (v11 and later).
    The markers are special tokens, so these requests keep special tokens in their text. Text before the
    first marker streams as content; the calls stream from it on."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    HEAD = re.compile(r'(?:\s*\[TOOL_CALLS\]\s*\[?|\s*,)\s*(?:\{\s*"name"\s*:\s*(?P<json_name>' + _JSON_STRING +
                      r')\s*,\s*"arguments"\s*:\s*|(?P<bare_name>[\w.-]+)\s*\[ARGS\]\s*)(?=[\[{])')
    SEPARATORS = " \t\r\n]"
    keeps_special_tokens = True

    def __init__(self):
        super().__init__()
        self.calling = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        if self.calling:
            return "", self._stream()
        at = self.buf.find(self.TAG)
        if at >= 0:
            content, self.buf, self.calling = self.text(self.buf[:at]), self.buf[at:], True
            return content, self._stream()
        keep = partial_tail(self.buf, self.TAG)
        content, self.buf = self.text(self.buf[:len(self.buf) - keep]), self.buf[len(self.buf) - keep:]
        return content, []

    def whole(self, text: str) -> list[tuple[str, str]]:
        found = []
        for part in text.split(self.TAG)[1:]:
            if self.ARGS in part:
                name, args = (s.strip() for s in part.split(self.ARGS, 1))
                json.loads(args, strict=False)  # the arguments must be JSON; they go out as written
                found.append((name, args))
                continue
            listed = json.loads(part, strict=False)
            for item in listed if isinstance(listed, list) else [listed]:
                found.append((item["name"], _arguments(item.get("arguments", {}))))
        return found

    def finish(self) -> tuple[str, list[dict]]:
        if not self.calling:
            held, self.buf = self.buf, ""
            return self.text(held) + self.rest(), []
        return self._finish_calls()


TOOL_CALL_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
                     "pythonic": PythonicParser}
