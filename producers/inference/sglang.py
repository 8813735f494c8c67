"""SGLang's native API: ``POST /generate`` (text or ``input_ids``), ``/abort_request``, and
the model it serves (``/get_model_info``).

SGLang streams the whole answer so far in every chunk by default, or only the new part
with ``--incremental-streaming-output``; which one is told apart from the chunk's
``output_ids`` against ``meta_info.completion_tokens``, so both work. A cumulative
chunk is read from its ``meta_info`` on, the last one whole.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from tokenbudget.core.apis import API_TRAITS
from tokenbudget.core.errors import (
    InferenceError,
    InferenceProtocolError,
    InferenceTransportError,
)
from tokenbudget.core.sampling import VERBATIM_KEY
from tokenbudget.producers.inference.generation import (
    GenerationRequest,
    GenerationResult,
    InferenceBackend,
)
from tokenbudget.producers.inference.replies import (
    as_finish,
    count_of,
    error_in_stream,
    field_at,
    int_list,
    not_json,
    stream_event,
    token_ids_of,
)


class _ChunkHead(msgspec.Struct):
    """What progress needs of an SGLang stream chunk; its text and ids are skipped
    unread (in cumulative streams they repeat the whole answer every chunk)."""

    meta_info: dict[str, Any] | None = None
    error: Any = None
    object: Any = None


_read_head = msgspec.json.Decoder(_ChunkHead).decode


def _head(data: bytes) -> _ChunkHead:
    """What progress needs of a cumulative chunk, read from its ``meta_info`` key on,
    which SGLang writes after the text and ids: they repeat the whole answer so far, and
    reading past them took a tenth of a dispatcher's CPU. The key is found from the
    end: an unescaped quote only ever delimits a string, and a string followed by a
    colon is a key. A chunk where that key is not the top level's (what follows it
    does not close the object) or is missing is read whole."""
    at = data.rfind(b'"meta_info":')
    if at > 0 and data[at - 1 : at] != b"\\":
        try:
            return _read_head(b"{" + data[at:])
        except (msgspec.DecodeError, RecursionError):
            pass
    return _read_head(data)


class _LastChunk(msgspec.Struct):
    """A cumulative stream's last chunk, the whole answer, read once: its ids typed by
    the decoder (converting them one by one took ~3% of a dispatcher's CPU samples)."""

    text: str = ""
    output_ids: list[int] | None = None
    token_ids: list[int] | None = None  # older servers' name
    meta_info: dict[str, Any] | None = None


_read_last = msgspec.json.Decoder(_LastChunk).decode


class _SGLangStream:
    """Accumulates SGLang chunks, cumulative or incremental, telling which from the
    ids against ``meta_info.completion_tokens`` (text-only streams: from the text)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text = ""
        self.incremental: bool | None = None
        self.meta: dict[str, Any] = {}
        self.has_ids = False

    def add(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise InferenceProtocolError(f"stream chunk is not an object: {str(chunk)[:200]}")
        meta = chunk.get("meta_info")
        if isinstance(meta, dict):
            self.meta = meta
        ids = int_list(chunk.get("output_ids", chunk.get("token_ids")))
        text = chunk.get("text")
        text = text if isinstance(text, str) else ""
        total = self.meta.get("completion_tokens") if isinstance(meta, dict) else None
        if self.incremental is None:
            self.incremental = self._mode(ids, text, total)
        if ids is not None:
            self.has_ids = True
            self.ids = self.ids + ids if self.incremental else ids
        self.text = self.text + text if self.incremental else text

    def add_last(self, url: str, data: bytes) -> None:
        """The last chunk of a cumulative stream (the whole answer); one the typed
        read refuses is read as any other chunk."""
        try:
            last = _read_last(data)
        except (msgspec.DecodeError, RecursionError):
            self.add(stream_event(url, data))
            return
        if last.meta_info is not None:
            self.meta = last.meta_info
        ids = last.output_ids if last.output_ids is not None else last.token_ids
        if ids is not None:
            self.has_ids = True
            self.ids = ids
        self.text = last.text

    def _mode(self, ids: list[int] | None, text: str, total: Any) -> bool | None:
        if ids is not None:
            if not self.ids:
                return None  # first chunk: both readings agree
            if isinstance(total, int):
                if len(self.ids) + len(ids) == total and len(ids) != total:
                    return True
                if len(ids) == total:
                    return False
            return ids[: len(self.ids)] != self.ids
        if not self.text:
            return None
        return not text.startswith(self.text)

    @property
    def tokens(self) -> int:
        total = self.meta.get("completion_tokens")
        return int(total) if isinstance(total, int) else len(self.ids)


# SGLang's sampling_params name for a setting where it differs from ours.
_SGLANG_NAMES = {"seed": "sampling_seed"}
# Settings that are not sampling_params on /generate: the template's are applied
# here (template = true), the extra body goes beside sampling_params.
_NOT_SAMPLING_PARAMS = frozenset({"chat_template_kwargs", VERBATIM_KEY})


class SGLangBackend(InferenceBackend):
    api = "sglang"
    _model_lookup: asyncio.Future[str] | None = None

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        sampling: dict[str, Any] = {"max_new_tokens": request.max_new_tokens}
        for key, value in request.sampling.items():
            if key not in _NOT_SAMPLING_PARAMS:
                sampling[_SGLANG_NAMES.get(key, key)] = value
        body: dict[str, Any] = {
            "rid": request.rid,
            "sampling_params": sampling,
            "stream": self.stream,
            **(request.sampling.get(VERBATIM_KEY) or {}),
        }
        if request.input_ids is not None:
            body["input_ids"] = list(request.input_ids)
        elif request.text is not None:
            body["text"] = request.text
        else:
            # /generate takes plain text; a chat prompt without a local template is
            # sent as the concatenated turns.
            body["text"] = "\n".join(m.content for m in request.messages or ())
        return body

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        body = self._body(request)
        first_token_at: float | None = None
        if not self.stream:
            data = await self._request("POST", "/generate", body, request.max_new_tokens)
            meta = field_at(data, "meta_info")
            output_ids = data.get("output_ids") if isinstance(data, dict) else None
            if output_ids is None:
                output_ids = data.get("token_ids") if isinstance(data, dict) else None  # old
            text = str(data.get("text", ""))
        else:
            url = self.base_url + "/generate"
            acc = _SGLangStream()
            last = b""  # the latest cumulative chunk, decoded in full only at the end
            async for batch in self._data("/generate", body, request.max_new_tokens):
                for data in batch:
                    if acc.incremental is False:
                        # Cumulative: each chunk repeats the answer so far; reading only
                        # its counts keeps a long answer's stream linear, not quadratic.
                        try:
                            head = _head(data)
                        except (msgspec.DecodeError, RecursionError) as exc:
                            raise not_json(url, data) from exc
                        if head.error is not None or head.object == "error":
                            raise error_in_stream(url, data)
                        if isinstance(head.meta_info, dict):
                            acc.meta = head.meta_info
                        last = data
                    else:
                        acc.add(stream_event(url, data))
                if first_token_at is None and (acc.tokens > 0 or acc.text or last):
                    first_token_at = time.time()
                self._progress(request, acc.tokens)
            if last:
                acc.add_last(url, last)
            meta = acc.meta
            if not meta or meta.get("finish_reason") is None:
                raise InferenceTransportError(
                    f"POST {self.base_url}/generate: the stream ended before the request finished"
                )
            output_ids = acc.ids if acc.has_ids else None
            text = acc.text
        where = self.base_url + "/generate"
        output_ids = token_ids_of(output_ids, "output_ids", where)
        if output_ids is None:
            raise InferenceProtocolError(
                "SGLang response has no output_ids: use a build that returns them"
            )
        return GenerationResult(
            rid=request.rid,
            prompt_tokens=count_of(
                field_at(meta, "prompt_tokens"), "meta_info.prompt_tokens", where
            ),
            completion_tokens=count_of(
                field_at(meta, "completion_tokens"), "meta_info.completion_tokens", where
            ),
            output_ids=output_ids,
            text=text,
            finish_reason=as_finish(meta.get("finish_reason")),
            first_token_at=first_token_at,
            model=await self._served_model(),
        )

    async def _served_model(self) -> str:
        """/generate names no model: ask /get_model_info once, shared by every
        request in flight meanwhile (the configured name if the server will not say)."""
        lookup = self._model_lookup
        if lookup is None:
            lookup = self._model_lookup = asyncio.ensure_future(self._model_info())
        if lookup.done():
            return lookup.result()  # every answer after the first: no shield to build
        return await asyncio.shield(lookup)

    async def _model_info(self) -> str:
        try:
            info = await self._request("GET", API_TRAITS[self.api].model_info_route, None)
        except InferenceError:
            return self.model  # an older server or a proxy without it: the name asked for
        path = info.get("model_path") if isinstance(info, dict) else None
        return path if isinstance(path, str) and path else self.model

    async def abort(self, rid: str) -> None:
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": False})
