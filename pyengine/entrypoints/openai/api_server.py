"""`python -m pyengine.serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

    python -m pyengine.serve [--model M] [--spec ngram|draft] [--num-spec-tokens K] [--draft-model P]
                             [--host 127.0.0.1] [--port 8000] [--device auto|cpu|cuda] [--dtype auto|...]

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream: server-sent events),
GET /v1/models, GET /health, GET /metrics (Prometheus text). One background thread owns the
engine (pyengine.engine.async_llm.AsyncLLM); requests join and leave between its steps. Bad
requests get HTTP 400 with an OpenAI-style error body; a model name other than the served one
gets 404 (model_not_found); no name means the served model.
"""
import argparse
import os
import time
from contextlib import asynccontextmanager
from typing import Any

from pyengine.entrypoints.cli_args import OneLineParser, add_engine_args, engine_kwargs, fail

try:  # the `serve` extra; main() says so when it is missing
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, PlainTextResponse

    from pyengine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body
    _MISSING = None
except ImportError as e:
    _MISSING = e

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m pyengine.serve", description=__doc__.splitlines()[0])
    add_engine_args(p)
    p.add_argument("--served-model-name", help="the model's name in the API (default: the model file's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    return p.parse_args(argv)


def model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if not args.model:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(args.model))
    return base[:-5] if base.endswith(".gguf") else base


def build_llm(args: argparse.Namespace):
    """The LLM the arguments describe; bad arguments end the process with one line (exit 2)."""
    kwargs = engine_kwargs(args)
    if args.model and not os.path.exists(args.model):
        fail(f"model file not found: {args.model}")
    from pyengine import LLM

    try:
        return LLM(seed=args.seed, **kwargs)
    except ValueError as e:
        fail(str(e).splitlines()[0])


def build_app(engine: Any, name: str):
    """The FastAPI app serving `engine` (an AsyncLLM) as model `name`. The app shuts the engine's
    loop down when it stops."""
    from pyengine.entrypoints.openai.metrics import ServerMetrics
    from pyengine.entrypoints.openai.serving import OpenAIServing

    metrics = ServerMetrics(name)
    engine.on_finish = metrics.request_finished
    serving = OpenAIServing(engine, name, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()

    app = FastAPI(title="pyengine", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        metrics.request_refused()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        metrics.request_refused()
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), None, kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):  # a bug: say so, keep serving
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", None, "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "pyengine",
                                            "max_model_len": engine.engine.cfg.max_model_len}]}

    @app.get("/metrics")
    async def metrics_endpoint():
        return PlainTextResponse(metrics.render(await engine.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        metrics.request_received()
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        metrics.request_received()
        return await serving.chat(body, request)

    return app


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import uvicorn
    except ImportError as e:
        fail(f"the server needs FastAPI and uvicorn: pip install -e '.[serve]' ({e})")
    if _MISSING is not None:
        fail(f"the server needs FastAPI and uvicorn: pip install -e '.[serve]' ({_MISSING})")
    from pyengine.engine.async_llm import AsyncLLM

    llm = build_llm(args)
    # every CUDA graph (the target's, a drafting layer's) now, not inside the first requests' steps
    captured = llm.engine.capture_graphs()
    if captured:
        print(f"pyengine: captured {captured} CUDA graphs", flush=True)
    app = build_app(AsyncLLM(llm), model_name(args))
    print(f"pyengine: serving {model_name(args)} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
