"""Server-sent events shaped like vLLM's: `data: {json}\\n\\n` chunks, an optional usage chunk, `data: [DONE]`.

Stream of one request:  [role chunk (chat)] -> content chunks -> last chunk with finish_reason
                        -> [usage chunk] -> [DONE]
A request that fails once the stream has started sends `data: {"error": {...}}` and then [DONE] (the status,
200, is already on the wire). A client that goes away shows up here as ConnectionResetError on write (or as
the handler's cancellation); either way the caller closes the engine generator, which aborts the request.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, TypeVar

from aiohttp import web

from hybridpd.engine.detokenizer import Detokenizer
from hybridpd.engine.request import FinishReason, RequestOutput
from hybridpd.engine.tokenizer import Tokenizer
from hybridpd.server.errors import http_error_for
from hybridpd.server.logprobs import chat_logprobs, completion_logprobs, token_names
from hybridpd.server.metrics import RequestTracker
from hybridpd.server.outputs import EngineOutputs
from hybridpd.server.protocol import Endpoint, ParsedRequest
from hybridpd.server.responses import completion_part, finish_reason_value, header, usage
from hybridpd.server.tool_calls import finish_reason as tool_finish_reason, read_output, tool_call_reader
from hybridpd.sse_keep_alive import KEEP_ALIVE, awaited

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, allow_nan=False).encode("utf-8") + b"\n\n"


class SseStream:
    """A request's server-sent-events response: prepared (status 200) when the first bytes are written or, with a
    keep-alive interval, as soon as a wait for them has lasted it (then a keep-alive comment goes out, and again
    each interval the stream waits)."""

    def __init__(self, request: web.Request, keep_alive: float | None = None) -> None:
        self._request = request
        self._interval = keep_alive
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    async def start(self, headers: dict[str, str] | None = None) -> web.StreamResponse:
        """The prepared response (`headers` go out only if it was not prepared yet)."""
        if self.response is None:
            response = web.StreamResponse(headers={**SSE_HEADERS, **(headers or {})})
            await response.prepare(self._request)
            self.response = response
        return self.response

    async def wait(self, pending: Awaitable[T]) -> T:
        """`pending`'s result, with keep-alive comments while it takes longer than the interval."""
        return await awaited(pending, self._interval, self._keep_alive)

    async def _keep_alive(self) -> None:
        response = await self.start()
        await response.write(KEEP_ALIVE)


class RequestFailed(Exception):
    """An output with finish_reason ERROR; carries the engine's error."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def failure(output: RequestOutput) -> Exception | None:
    """The error of a failed output (an ERROR without one is our bug: a bare RuntimeError, mapped to 500)."""
    if output.finish_reason is not FinishReason.ERROR:
        return None
    return output.error if output.error is not None else RuntimeError("request failed without an error")


class ChunkBuilder:
    """Turns each output of one request into its chunks; remembers what the stream has sent so far."""

    def __init__(self, parsed: ParsedRequest, model: str, tokenizer: Tokenizer) -> None:
        self._parsed = parsed
        self._tokenizer = tokenizer
        self._name = token_names(tokenizer, parsed.tokens_as_ids)
        self._object = "text_completion" if parsed.endpoint is Endpoint.COMPLETIONS else "chat.completion.chunk"
        self._header = header(parsed, model, self._object)
        self._text_offset = 0
        self._started = False
        self._generated = 0   # output tokens so far (the usage every chunk carries with continuous_usage)
        self._tools = tool_call_reader(parsed.tool_use) if parsed.tool_use is not None else None

    def _chunk(self, choice: dict[str, Any], output: RequestOutput) -> dict[str, Any]:
        chunk = self._with_usage({**self._header, "choices": [choice]}, self._generated)
        if output.kv_transfer_params is not None:
            chunk["kv_transfer_params"] = output.kv_transfer_params
        return chunk

    def _with_usage(self, chunk: dict[str, Any], generated: int) -> dict[str, Any]:
        """`chunk` with the usage so far when the stream asks for it in every chunk (as vLLM counts it)."""
        if self._parsed.continuous_usage:
            prompt = len(self._parsed.engine_request.prompt_token_ids)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": generated,
                              "total_tokens": prompt + generated}
        return chunk

    def _completion_choice(self, output: RequestOutput) -> dict[str, Any]:
        part = completion_part(self._parsed, output.new_text, output.logprobs, output.new_token_ids,
                               output.prompt_logprobs, first=not self._started)
        logprobs = None
        if self._parsed.wants_logprobs:
            logprobs, self._text_offset = completion_logprobs(part.logprobs, self._name, self._text_offset,
                                                              part.token_ids)
        choice: dict[str, Any] = {
            "index": self._parsed.index, "text": part.text, "logprobs": logprobs,
            "finish_reason": finish_reason_value(output.finish_reason), "stop_reason": output.stop_reason,
        }
        if self._parsed.return_token_ids:
            if not self._started:
                choice["prompt_token_ids"] = list(self._parsed.engine_request.prompt_token_ids)
            choice["token_ids"] = list(output.new_token_ids)
        return choice

    def _chat_choice(self, output: RequestOutput) -> dict[str, Any]:
        reason = finish_reason_value(output.finish_reason)
        if self._tools is None:
            delta = {"content": output.new_text} if output.new_text or output.new_token_ids else {}
        else:
            delta = self._tool_delta(output)
            reason = tool_finish_reason(self._parsed.tool_use, self._tools.called, reason)
        choice: dict[str, Any] = {
            "index": self._parsed.index,
            "delta": delta,
            "logprobs": chat_logprobs(output.logprobs, self._name) if self._parsed.wants_logprobs else None,
            "finish_reason": reason,
        }
        if self._parsed.return_token_ids:
            choice["token_ids"] = list(output.new_token_ids)
        return choice

    def _tool_delta(self, output: RequestOutput) -> dict[str, Any]:
        """The output's text read for tool calls: its content (what is not a call) and the pieces of calls."""
        assert self._tools is not None
        read = read_output(self._tools, output.new_text, output.finished)
        calls = [piece.delta() for piece in read.calls]
        shows_content = read.content or (output.new_token_ids and not calls)
        delta: dict[str, Any] = {"content": read.content} if shows_content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The chunks of `output`: the chat's first output also makes the role chunk before its own (and with `echo`
        one holding the final message's text). Every output that carries a token makes a chunk, as vLLM streams: one
        whose token is half a UTF-8 character (the detokenizer holds it back) has empty text, so a client's
        inter-token latency counts every token, not two at once."""
        self._generated += len(output.new_token_ids)
        if self._parsed.stream_head is not None and not self._started:
            return self._after_head(output)
        chunks = []
        is_chat = self._parsed.endpoint is Endpoint.CHAT
        if is_chat and not self._started:
            chunks.append(self._chat_head({"role": self._parsed.role, "content": ""}))
            if self._parsed.echo is not None:   # the final message's text, before the output (vLLM's chat echo)
                chunks.append(self._chat_head({"content": self._parsed.echo.text}))
        completion_echo = not is_chat and self._parsed.echo is not None and not self._started   # on the first output
        if output.new_text or output.finished or output.new_token_ids or completion_echo:
            chunks.append(self._chunk(self._choice(output), output))
        self._started = True
        return chunks

    def _chat_head(self, delta: dict[str, Any]) -> dict[str, Any]:
        """A chunk before the first output's: the role's, or the echoed final message's."""
        return self._with_usage({**self._header, "choices": [{"index": self._parsed.index, "delta": delta,
                                                              "logprobs": None, "finish_reason": None}]}, 0)

    def _choice(self, output: RequestOutput) -> dict[str, Any]:
        return self._chat_choice(output) if self._parsed.endpoint is Endpoint.CHAT else self._completion_choice(output)

    def _after_head(self, first: RequestOutput) -> list[dict[str, Any]]:
        """The first output of a stream whose head the client has (hybridpd/stream_head.py): its token is in that
        head, so it makes no chunk (it still moves the logprobs' text offset on), unless it is also the last
        output: then one chunk with its finish_reason and the text the head held back (the prefill node released
        its token's text as a stream does mid-way; at max_tokens the rest is released now)."""
        self._choice(first)
        self._started = True
        if not first.finished:
            return []
        text = ""
        if first.finish_reason is FinishReason.LENGTH:  # the head held back what a stream holds back mid-way
            sampling = self._parsed.engine_request.sampling
            shown, _ = Detokenizer.of(self._tokenizer, sampling).step(
                list(first.new_token_ids), final=False, match_stops=len(first.new_token_ids) > sampling.min_tokens)
            text = first.new_text[len(shown):]
        last = replace(first, new_token_ids=(), new_text=text, logprobs=())
        return [self._chunk(self._choice(last), last)]

    def usage_chunk(self, body_usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._header, "choices": [], "usage": body_usage}


async def stream_outputs(
    stream: SseStream,
    parsed: ParsedRequest,
    first: RequestOutput,
    rest: EngineOutputs,
    builder: ChunkBuilder,
    tracker: RequestTracker,
    headers: dict[str, str],
) -> web.StreamResponse:
    """Streams `first` and then `rest` until the finished output, onto `stream` (prepared already when keep-alive
    comments went out before the first output). Returns the prepared response; never raises for a failed request
    (the error goes into the stream), only for cancellation."""
    response = await stream.start(headers)
    output = first
    try:
        while True:
            await write_output(response, builder, tracker, output)
            if output.finished:
                break
            output = await stream.wait(rest.next())
        if parsed.include_usage:
            await response.write(sse(builder.usage_chunk(usage(output))))
    except ConnectionResetError:
        return response  # the client went away: nothing more to say to it
    except Exception as exc:  # noqa: BLE001 - a failure after the status went out becomes an error event
        return await end_stream(response, exc)
    return await end_stream(response, None)


async def write_output(response: web.StreamResponse, builder: ChunkBuilder, tracker: RequestTracker,
                       output: RequestOutput) -> None:
    """One output's chunks onto the stream; a failed output raises RequestFailed."""
    tracker.observe(output)
    error = failure(output)
    if error is not None:
        raise RequestFailed(error)
    for chunk in builder.chunks(output):
        await response.write(sse(chunk))


async def end_stream(response: web.StreamResponse, error: Exception | None) -> web.StreamResponse:
    """The stream's end: the error event of a failure after the status went out, then [DONE] (to a client still
    there)."""
    try:
        if error is not None:
            cause = error.error if isinstance(error, RequestFailed) else error
            await response.write(sse(http_error_for(cause).body()))
        await response.write(DONE)
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response
