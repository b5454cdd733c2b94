"""Tool calls in the models' own format, and running them with a time limit.

Hermes / Qwen2.5 / Qwen3 models call a tool by writing, in their turn,

    <tool_call>
    {"name": "python", "arguments": {"code": "print(2 ** 10)"}}
    </tool_call>

(the format their chat templates teach with `tools=`). `parse_tool_calls(text)` finds every such
block; a block that is not a JSON object with a string "name" and an object "arguments" becomes a
ToolCall with `error` set, and `run_tool_calls` answers it with that error as the tool's output, so
the model can read what was wrong and retry: a malformed call never stops the run.
"""

import json
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


@dataclass
class ToolCall:
    name: str | None
    arguments: dict | None
    error: str | None = None  # why the block is not a usable call (then name/arguments may be None)


def parse_tool_calls(text):
    """Every <tool_call>...</tool_call> block of `text`, in order (an unclosed last block counts: the
    model may have been cut off inside it). [] when there is none."""
    calls = []
    for match in TOOL_CALL.finditer(text):
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(
                ToolCall(None, None, f"the tool call is not valid JSON ({e.msg} at char {e.pos}): {body[:200]}")
            )
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall(None, None, 'a tool call is a JSON object {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", call.get("parameters", {}))  # (Llama 3 writes "parameters")
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(call["name"], None, f'the "arguments" of {call["name"]} must be a JSON object'))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


class ToolError(Exception):
    """A tool's failure, told to the model as this message alone (without an exception type)."""


def call_with_timeout(fn, timeout_s):
    """fn() in a daemon thread, waited for at most timeout_s seconds: (value, error text or None,
    timed_out). A Python thread cannot be killed: one that hangs is left behind (daemon: it does
    not hold up the exit); code that may hang for good belongs in the sandbox (common/env/sandbox.py),
    whose process is killed at its limit."""
    future = Future()

    def target():
        try:
            future.set_result(fn())
        except BaseException as e:  # the tool's own failure, reported to the model
            future.set_exception(e)

    threading.Thread(target=target, daemon=True).start()
    try:
        return future.result(timeout=timeout_s), None, False
    except TimeoutError as e:  # ours, or the tool's own (the sandbox's limit): a timeout either way
        return None, str(e) if future.done() else f"timed out after {timeout_s:g} s", True
    except ToolError as e:
        return None, str(e), False
    except Exception as e:
        return None, f"{type(e).__name__}: {e}", False


def truncate(text, max_chars):
    """text cut to max_chars characters, saying how much was left out (the model sees the note)."""
    text = str(text)
    if max_chars is None or len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n... ({len(text) - max_chars} more characters cut)"


def run_tool_calls(calls, tools, *, timeout_s=10.0, max_chars=4096):
    """Run parsed calls with `tools` (name -> function taking the arguments as keywords) -> (messages,
    counts): one {"role": "tool", "content": output} message per call (errors included, as text the
    model reads), and dict(tool_calls, tool_errors, tool_timeouts, tool_s)."""
    counts = dict(tool_calls=len(calls), tool_errors=0, tool_timeouts=0)
    messages, start = [], time.time()
    for call in calls:
        if call.error is None and call.name not in tools:
            call.error = f"unknown tool {call.name!r}; the tools are: {', '.join(sorted(tools))}"
        if call.error is not None:
            output, error, timed_out = None, call.error, False
        else:
            fn, arguments = tools[call.name], call.arguments
            output, error, timed_out = call_with_timeout(lambda: fn(**arguments), timeout_s)
        counts["tool_errors"] += error is not None
        counts["tool_timeouts"] += timed_out
        content = f"error: {error}" if error is not None else output
        messages.append({"role": "tool", "content": truncate(content, max_chars)})
    counts["tool_s"] = time.time() - start
    return messages, counts
