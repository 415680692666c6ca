"""Tool calls written as JSON, read one character at a time so that the arguments stream
as they are generated: `{"name": ..., "arguments": {...}}` (or `"parameters"`), or a list
of such objects. The reader knows where the arguments value starts and where it ends
(depth and strings tracked), so no closing brace needs guessing."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection

ARGUMENT_KEYS = ("arguments", "parameters")
MORE, DONE, FAIL = "more", "done", "fail"


class JsonValueScan:
    """Follows one JSON object or array; `push` says when its last character came."""

    def __init__(self):
        self.depth = 0
        self._in_str = False
        self._esc = False

    def push(self, ch: str) -> bool:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
        elif ch == '"':
            self._in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class CallReader:
    """Reads one call object. Callbacks: `on_name(name) -> bool` (False refuses the call:
    the reader fails), `on_args(fragment)`. The call is said (`on_name`) once its name has
    come and its arguments are known to be an object (or absent), so that arguments of
    another kind leave no call. Arguments written before the name are held until it
    comes; arguments given as a JSON string are said once, decoded."""

    def __init__(self, on_name: Callable[[str], bool], on_args: Callable[[str], None],
                 whole: bool = False):
        self._on_name, self._on_args = on_name, on_args
        self._whole = whole  # arguments held until they parse as a whole object
        self._state = "open"
        self._tok = ""  # the key, the name string, or a held value
        self._key = ""
        self._scan: JsonValueScan | None = None
        self._named = False  # the name has come
        self._said = False  # the call has been said
        self._name = ""
        self._held_args: list[str] = []
        self.has_args = False

    def _args(self, text: str) -> None:
        self.has_args = True
        if self._said:
            self._on_args(text)
        else:
            self._held_args.append(text)

    def _say(self) -> bool:
        """The call is certain: said, with the arguments held so far; False if refused."""
        if not self._said:
            if not self._on_name(self._name):
                return False
            self._said = True
            for a in self._held_args:
                self._on_args(a)
            self._held_args.clear()
        return True

    def push(self, ch: str) -> str:
        s = self._state
        if s in ("open", "key_or_end", "colon", "value", "after") and ch.isspace():
            return MORE
        if s == "open":
            if ch != "{":
                return FAIL
            self._state = "key_or_end"
        elif s == "key_or_end":
            if ch == "}":
                return self._close()
            if ch != '"':
                return FAIL
            self._state, self._tok = "key", ch
        elif s in ("key", "name"):
            self._tok += ch
            if ch == '"' and not _escaped(self._tok):
                try:
                    text = json.loads(self._tok)
                except ValueError:
                    return FAIL
                if s == "key":
                    self._key, self._state = text, "colon"
                else:
                    if self._named or not isinstance(text, str):
                        return FAIL
                    self._named, self._name = True, text
                    if self.has_args and not self._say():  # the arguments came first
                        return FAIL
                    self._state = "after"
        elif s == "colon":
            if ch != ":":
                return FAIL
            self._state = "value"
        elif s == "value":
            return self._value_start(ch)
        elif s == "args":
            self._args(ch)
            if self._scan.push(ch):
                self._state = "after"
                if self._whole and not self._whole_args():
                    return FAIL
        elif s in ("args_str", "skip"):
            return self._held_value(ch)
        elif s == "after":
            if ch == ",":
                self._state = "key_or_end"
            elif ch == "}":
                return self._close()
            else:
                return FAIL
        return MORE

    def _whole_args(self) -> bool:
        """Held arguments complete: whether they parse as an object (then said if named)."""
        try:
            args = json.loads("".join(self._held_args))
        except ValueError:
            return False
        return isinstance(args, dict) and (not self._named or self._say())

    def _value_start(self, ch: str) -> str:
        if self._key == "name":
            if ch != '"':
                return FAIL
            self._state, self._tok = "name", ch
        elif self._key in ARGUMENT_KEYS and not self.has_args:
            if ch == '"':
                self._state, self._tok = "args_str", ch
                return MORE
            if ch != "{" or (self._named and not self._whole and not self._say()):
                return FAIL  # arguments that are not an object: no call
            self._scan, self._state = JsonValueScan(), "args"
            self._args(ch)
            self._scan.push(ch)
        else:  # another key's value: read past it
            self._state, self._tok, self._scan = "skip", "", JsonValueScan()
            return self._held_value(ch)
        return MORE

    def _held_value(self, ch: str) -> str:
        if self._state == "args_str":
            self._tok += ch
            if ch == '"' and not _escaped(self._tok):
                try:
                    args = json.loads(json.loads(self._tok))
                except ValueError:
                    return FAIL
                if not isinstance(args, dict) or (self._named and not self._say()):
                    return FAIL
                self._args(json.dumps(args, ensure_ascii=False))
                self._state = "after"
            return MORE
        # skip: a string, an object or array, or a scalar that ends where ',' '}' or space is
        first = self._tok[:1]
        if first not in ('"', "{", "[") and self._tok and (ch in ",}" or ch.isspace()):
            self._state = "after"
            return self.push(ch)
        self._tok += ch
        if first == '"' or (not first and ch == '"'):
            if len(self._tok) > 1 and ch == '"' and not _escaped(self._tok):
                self._state = "after"
        elif (first or ch) in "{[":
            if self._scan.push(ch):
                self._state = "after"
        elif not (ch.isalnum() or ch in "+-."):
            return FAIL
        return MORE

    def _close(self) -> str:
        if not self._named or not self._say():
            return FAIL
        if not self.has_args:
            self._args("{}")
        return DONE


def _escaped(quoted: str) -> bool:
    """Whether the final quote of `quoted` is escaped (an odd run of backslashes before)."""
    n = len(quoted) - 1
    run = 0
    while n - 1 - run >= 0 and quoted[n - 1 - run] == "\\":
        run += 1
    return run % 2 == 1 or len(quoted) == 1


class CallsReader:
    """One call object, or a list of them (`[{...}, {...}]`) when `lists` allows. Calls
    come out through `start(name) -> bool` (False: not a declared tool) and `args`;
    with `whole`, a call's arguments come out at once, once they parse."""

    def __init__(self, tool_names: Collection[str], start: Callable[[str], bool],
                 args: Callable[[str], None], lists: bool = True, whole: bool = False):
        self._names, self._start, self._args = tool_names, start, args
        self._lists, self._whole = lists, whole
        self._state = "first"
        self._call: CallReader | None = None
        self.calls = 0

    def _new_call(self) -> CallReader:
        def on_name(name: str) -> bool:
            return name in self._names and self._start(name)
        return CallReader(on_name, self._args, self._whole)

    def push(self, ch: str) -> str:
        s = self._state
        if s == "first":
            if ch.isspace():
                return MORE
            if ch == "[" and self._lists:
                self._state = "item"
                return MORE
            self._state, self._call = "single", self._new_call()
            return self._call_push(ch, DONE)
        if s == "single":
            return self._call_push(ch, DONE)
        if s == "item":
            if ch.isspace():
                return MORE
            if ch == "]" and self.calls:
                return DONE
            self._state, self._call = "in_item", self._new_call()
            return self._call_push(ch, MORE)
        if s == "in_item":
            return self._call_push(ch, MORE)
        # between items
        if ch.isspace():
            return MORE
        if ch == ",":
            self._state = "item"
            return MORE
        return DONE if ch == "]" else FAIL

    def _call_push(self, ch: str, on_done: str) -> str:
        r = self._call.push(ch)
        if r == DONE:
            self.calls += 1
            if on_done == MORE:
                self._state = "between"
            return on_done
        return r
