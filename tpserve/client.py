"""`tpserve client`: send one prompt to a running server and stream the reply's text to stdout.

The finish reason and usage go to stderr, so stdout holds the reply alone.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from tpserve.ranks.errors import UserError
from tpserve.server.api_key import API_KEY_ENV
from tpserve.v1 import serving_pb2, serving_pb2_grpc


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "client", help="stream one reply from a running server", description=__doc__
    )
    parser.add_argument("--target", required=True, help="the server's host:port")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw prompt text (no chat template)")
    source.add_argument("--chat", help="one user message, sent through the model's chat template")
    parser.add_argument("--system", help="a system message before --chat")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat for more)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--background", action="store_true", help="run at background priority")
    parser.add_argument("--timeout", type=float, help="give up after this many seconds")
    parser.add_argument("--api-key", default=None, help=f"sent as Bearer KEY (default: ${API_KEY_ENV})")
    parser.add_argument("--ca-file", help="TLS: a PEM file of the CA that signed the server's certificate")
    parser.set_defaults(run=run)


def build_request(args: argparse.Namespace) -> serving_pb2.GenerateRequest:
    request = serving_pb2.GenerateRequest(
        stop=args.stop, ignore_eos=args.ignore_eos, background=args.background
    )
    if args.prompt is not None:
        request.prompt = args.prompt
    else:
        if args.system is not None:
            request.messages.add(role="system", content=args.system)
        request.messages.add(role="user", content=args.chat)
    # Only the flags given are set, so the server's defaults apply to the rest.
    for field in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed"):
        value = getattr(args, field)
        if value is not None:
            try:
                setattr(request, field, value)
            except ValueError as error:  # out of the field's range, e.g. a negative seed
                raise UserError(f"--{field.replace('_', '-')} {value}: {error}") from error
    return request


def describe_finish(response: serving_pb2.GenerateResponse) -> str:
    usage = response.usage
    reason = serving_pb2.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
    first = (
        f"first token {usage.time_to_first_token_s:.3f} s, "
        if usage.HasField("time_to_first_token_s")
        else ""
    )
    line = (
        f"[{reason}: {usage.prompt_tokens} prompt tokens ({usage.cached_tokens} cached), "
        f"{usage.completion_tokens} completion tokens, {first}total {usage.total_s:.3f} s]"
    )
    return f"{line} {response.error}" if response.error else line


def open_channel(target: str, ca_file: str | None) -> grpc.Channel:
    """Plain, or TLS trusting the CA in `ca_file` (a server started with ssl_certfile)."""
    if ca_file is None:
        return grpc.insecure_channel(target)
    with open(ca_file, "rb") as file:
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=file.read()))


def run(args: argparse.Namespace) -> int:
    request = build_request(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, "")
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    final = None
    with open_channel(args.target, args.ca_file) as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                if response.text:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                if response.finish_reason != serving_pb2.FINISH_REASON_UNSPECIFIED:
                    final = response
        except grpc.RpcError as error:
            sys.stdout.flush()
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if final is None:
        print("error: the stream ended without a finish reason", file=sys.stderr)
        return 1
    print(describe_finish(final), file=sys.stderr)
    return 1 if final.finish_reason == serving_pb2.FINISH_REASON_ERROR else 0
