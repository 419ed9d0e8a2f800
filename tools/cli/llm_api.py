"""An OpenAI-compatible HTTP API in front of the LLM models of a running tritonserver.

    python -m tools llm-api                              # :9000, tritonserver's gRPC on localhost:8001
    python -m tools llm-api --port 9000 --triton-url localhost:8001 --model llm

Any OpenAI client talks to it: the base URL is http://HOST:PORT/v1 and the API key is the
tenant's token (`python -m tools tenant-token TENANT`), or `anonymous` for the spec's
anonymous tenant where its `[tenants.auth]` allows one. It serves `/v1/chat/completions`
(the model's own chat template), `/v1/completions` and `/v1/models`, streamed (server-sent
events, `data: [DONE]` last) or not, with `max_tokens`, `temperature`, `top_p`, `seed`,
`stop` and usage counts. Generation, quotas, metrics and authentication are the `llm`
model's own: each request is one generation over Triton's gRPC stream, and closing a stream
cancels its generation. Errors are OpenAI's shape: 400 bad request, 401 bad token, 404
unknown model, 429 over the tenant's token quota, 503 busy.

Options, printing and wiring only: the API is `tools.llm_api.app`, its shapes
`tools.llm_api.protocol`.
"""

from __future__ import annotations

import argparse

from tools.clients.tls import add_ca_argument
from tools.server.triton_server import busy_ports

DEFAULT_PORT = 9000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address the API listens on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the API's port (default {DEFAULT_PORT})")
    parser.add_argument("--triton-url", default="localhost:8001",
                        help="tritonserver's gRPC address (default localhost:8001)")
    parser.add_argument("--model", action="append", dest="models", metavar="NAME",
                        help="an LLM model to serve, as the clients name it (repeatable; default: llm)")
    add_ca_argument(parser)


def run(args: argparse.Namespace) -> int:
    from tools.llm_api.app import serve

    if busy_ports({"--port": args.port}, args.host):  # one line, not a traceback from inside uvicorn
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port}: it is in use; choose another --port")
    models = args.models or ["llm"]
    print(f"OpenAI-compatible API on http://{args.host}:{args.port}/v1 for {', '.join(models)} "
          f"(tritonserver gRPC {args.triton_url})", flush=True)
    serve(args.triton_url, args.host, args.port, models, args.grpc_tls_ca)
    return 0
