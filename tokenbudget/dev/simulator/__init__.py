"""A simulated SGLang / vLLM inference server for machines without GPUs.

It speaks the real wire formats (SGLang native ``/generate`` + ``/abort_request`` and the
OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` of both servers), so
the client code runs unchanged against a real server.  Completion lengths come from a
per-profile lognormal distribution chosen by a marker in the prompt text, and are a pure
function of ``(seed, prompt text)`` so a rerun reproduces the same token counts.

Behaviour worth knowing when reading client code against it:

* Decoding takes ``tokens / tokens_per_second`` of wall time per request, independent of
  how many requests run at once (a real server batches, so per-request speed is what the
  client experiences).
* A client that disconnects does NOT stop the request: like SGLang, the simulator keeps
  decoding to the natural end and logs the full ``completion_tokens``.  Only
  ``/abort_request`` stops a request early.
* A rid that is still decoding cannot be reused (SGLang rejects duplicate request ids
  with 400), which matters for clients that retry with the same rid after a timeout.
* With ``reasoning_style`` other than ``none`` it is a thinking model: each answer
  thinks first (a share of its length drawn from the prompt), closed by one token
  that renders as ``</think>``, then answers. Chat answers send the thinking in
  ``message.reasoning_content`` (SGLang's ``--reasoning-parser``) or
  ``message.reasoning`` (vLLM), streamed in the same fields of ``delta``, and count
  it in ``usage.completion_tokens_details.reasoning_tokens``; raw APIs send it inline.
  ``chat_template_kwargs`` turning thinking off, or a prompt ending in ``</think>``
  (a template that closed the block), make it answer straight away.
* With ``tool_calls``, a chat request that offers ``tools`` and ends with a user's
  turn is answered by a call to the first one (``finish_reason`` ``tool_calls``),
  with the arguments ``{"query": <that user turn's content>}``; one that ends with a
  tool's result is answered in text, as a model reads the result and answers.
* Its request log (``log_file``) says, for a chat request, what each message held
  (role, a crc32 of its content, its tool calls' ids, a tool result's call id,
  whether it carried reasoning), and the ids of the calls it answered with: enough
  to tell, from outside, which history each turn of a conversation was sent.

The server is a few parts composed by ``_SimServer`` (``server``, with the entry points
``start`` and ``serve``): the generation engine every API shares (``engine``; the pure
generation in ``generation``, a request as parsed in ``request``), the routes of each
API (``routes_sglang``, ``routes_openai``; ``server.ROUTES`` says which serves which,
their differences are the APIs' traits, ``tokenbudget.core.apis``), the injected
faults (``faults``) and the request log (``log``); what it is told and what it
records are in ``config``.
"""
