"""The OpenAI-compatible HTTP app over a `BatchEngine`.

    GET  /v1/models            the served model
    GET  /health               200, or 503 once the engine loop has died
    GET  /metrics              Prometheus text (`smc_sd.serve.metrics`)
    POST /v1/chat/completions  messages -> chat.completion (or chat.completion.chunk events)
    POST /v1/completions       prompt -> text_completion (or text_completion events)

A completion request is parsed and judged (`smc_sd.serve.parsing`), one engine `Request` is made
per choice (n per prompt, seeds seed + i), the engine checks them (`BatchEngine.check`: context
window, tokenizers, constraint lowering) in a worker thread, and they are submitted together.
Every refusal up to there is an HTTP error in OpenAI's shape; a stream starts only after that.
The engine loop runs in one background thread (`Server.start`); handlers await its events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from smc_sd.constraints.json_depth import JSONTooDeepError, load_json
from smc_sd.drafts import parse_draft
from smc_sd.serve.errors import APIError, bad_request, engine_dead, run_failed
from smc_sd.serve.metrics import CONTENT_TYPE, prometheus_text
from smc_sd.serve.parsing import Parsed, ServedModel, parse
from smc_sd.serve.responses import Shapes, choice_text, smc_object, usage
from smc_sd.serve.runs import Run
from smc_sd.serve.text import TextDeltas


class Server:
    """The engine, the models its requests' programs run on, and the loop thread.

    Args:
        engine: a `smc_sd.engine.batch.BatchEngine` over `target` and the drafts.
        target: the engine's target.
        drafts: the draft models the server loaded, by the name requests give in `draft` (None
            or empty: the free draft alone, which needs no model).
        name: the model name clients send and /v1/models lists.
        default_draft: the draft of requests that name none and have no structured output
            (default: the first loaded, else "free").
    """

    def __init__(self, engine, target, drafts: dict | None, name: str, default_draft: str | None = None):
        self.engine, self.target, self.drafts = engine, target, dict(drafts or {})
        self.model = ServedModel(name, target.tokenizer, target.vocabulary.size, tuple(self.drafts), default_draft)
        self.created = int(time.time())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the engine loop in a daemon thread until `stop`."""
        self._thread = threading.Thread(target=self.engine.run_forever, args=(self._stop,), name="smc-sd-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def requests(self, parsed: Parsed) -> list:
        """One engine Request per choice: for each prompt, one per seed (choice index p * n + i)."""
        from smc_sd.engine.batch import Request

        models = (self.target,)
        if parsed.draft is not None:
            # parsing has refused a draft the server did not load
            choice = parse_draft(parsed.draft)
            models += (self.drafts[choice.lm] if choice.has_lm else None,)
        program = parsed.module.program(*models, **parsed.options)
        return [Request(prompt, program, parsed.schedule, seed, parsed.stop) for prompt in parsed.prompts for seed in parsed.seeds]

    def check(self, requests: list, endpoint: str) -> None:
        """`engine.check` for each prompt (its n choices differ only in seed), refusals as 400s."""
        from smc_sd.backends.base import ContextOverflowError

        seen = set()
        for request in requests:
            if tuple(request.prompt) in seen:
                continue
            seen.add(tuple(request.prompt))
            try:
                self.engine.check(request)
            except ContextOverflowError as error:
                param = "messages" if endpoint == "chat" else "prompt"
                raise bad_request(" ".join(str(error).split()), param, "context_length_exceeded") from None
            except ValueError as error:
                raise bad_request(" ".join(str(error).split())) from None


def build_app(server: Server) -> FastAPI:
    """The FastAPI app serving `server` (its lifespan starts and stops the engine loop)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        server.start()
        yield
        server.stop()

    app = FastAPI(title="smc-sd", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def internal_error(_request, error: Exception):
        # a bug, not bad input: still one line in OpenAI's shape
        failed = run_failed(error)
        return JSONResponse(failed.body(), status_code=failed.status)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model.name, "object": "model", "created": server.created,
                                            "owned_by": "smc-sd", "max_model_len": server.target.max_length}]}

    @app.get("/health")
    async def health():
        if server.engine.dead is not None:
            return JSONResponse(engine_dead(server.engine.dead).body(), status_code=503)
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(server.engine.stats()), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        return await complete(server, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await complete(server, request, "completion")

    return app


async def complete(server: Server, client: HTTPRequest, endpoint: str):
    """Parse, check and submit one completion request; answer it whole or as a stream."""
    if server.engine.dead is not None:
        raise engine_dead(server.engine.dead)
    try:
        body = load_json(await client.body(), "the request body")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not JSON: {error}") from None
    except JSONTooDeepError as error:
        raise bad_request(str(error), code="json_too_deep") from None
    # parsing tokenizes and compiles constraints; checking lowers them: off the event loop
    parsed = await asyncio.to_thread(parse, body, endpoint, server.model)
    requests = await asyncio.to_thread(server.requests, parsed)
    await asyncio.to_thread(server.check, requests, endpoint)
    run = Run(asyncio.get_running_loop())
    await asyncio.to_thread(run.submit, server.engine, requests)
    shapes = Shapes(endpoint, server.model.name)
    if parsed.stream:
        return StreamingResponse(stream(server, parsed, requests, run, shapes), media_type="text/event-stream")
    try:
        results = {}
        async for index, event in run.events(client):
            if event.kind == "error":
                raise run_failed(event.error)
            if event.kind == "done":
                results[index] = event.result
    finally:
        run.cancel()
    if len(results) < len(requests):
        # the client went away; nobody reads this answer
        return JSONResponse({}, status_code=499)
    choices = []
    for index, request in enumerate(requests):
        text, finish = choice_text(results[index], parsed.cut_at)
        choices.append(shapes.choice(index, text, finish, choice_smc(server, parsed, request, results[index])))
    counts = usage(sum(len(p) for p in parsed.prompts), sum(len(r.tokens) for r in results.values()))
    return JSONResponse(shapes.answer(choices, counts))


def choice_smc(server: Server, parsed: Parsed, request, result) -> dict:
    """The smc object of one choice."""
    draft_len = request.program.proposal.draft_len if request.program.proposal is not None else 0
    return {**smc_object(result, request.seed, draft_len, parsed.cut_at, parsed.return_particles), "draft": parsed.draft}


def sse(obj) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj)}\n\n"


async def stream(server: Server, parsed: Parsed, requests: list, run: Run, shapes: Shapes):
    """The chunks of every choice as their text becomes final, each choice's last chunk with its
    finish_reason and smc object, a usage chunk if asked, then `data: [DONE]`. A client that
    disconnects cancels the run (the generator is closed at its next await)."""
    decode = server.target.decode
    deltas = [TextDeltas(decode, parsed.cut_at) for _ in requests]
    usage_null = parsed.include_usage
    try:
        if parsed.endpoint == "chat":
            for index in range(len(requests)):
                yield sse(shapes.chunk(index, first=True, with_usage=usage_null))
        completion_tokens = 0
        async for index, event in run.events():
            if event.kind == "tokens":
                text = deltas[index].delta(event.stable_tokens)
                if text:
                    yield sse(shapes.chunk(index, text, with_usage=usage_null))
            elif event.kind == "done":
                text, finish = choice_text(event.result, parsed.cut_at)
                rest = deltas[index].rest(text)
                if rest:
                    yield sse(shapes.chunk(index, rest, with_usage=usage_null))
                smc = choice_smc(server, parsed, requests[index], event.result)
                yield sse(shapes.chunk(index, finish_reason=finish, smc=smc, with_usage=usage_null))
                completion_tokens += len(event.result.tokens)
            else:
                yield sse(run_failed(event.error).body())
                break
        else:
            if parsed.include_usage:
                yield sse(shapes.usage_chunk(usage(sum(len(p) for p in parsed.prompts), completion_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        run.cancel()
