"""`corolla generate MODEL --initial-peers ... "prompt"`: stream a completion from the swarm to stdout."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING, Any, TextIO

from corolla.cli.common import CLIENT_HOST, add_client_args, add_dht_prefix, add_swarm_args, client_config
from corolla.cli.signals import exit_now, exit_on
from corolla.config import ClientConfig
from corolla.errors import InvalidRequest, LengthLimit

if TYPE_CHECKING:  # imported when the command runs: `corolla --help` stays quick
    from corolla.decoding.sampling import SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with a model served by the swarm",
        description="Generate a completion of PROMPT with MODEL's blocks running on the swarm (reached "
        "through --initial-peers, which is required), printing tokens as they arrive. Chat models get "
        "their chat template applied (see --raw).",
    )
    parser.add_argument(
        "model", metavar="MODEL", help="the same model folder, .gguf file or alias as the servers"
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the user's message (or raw text with --raw)")
    add_dht_prefix(parser, ClientConfig)
    add_generation_args(parser)
    add_client_args(parser)
    add_swarm_args(parser, default_host=CLIENT_HOST)
    parser.set_defaults(run=run)


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generation")
    group.add_argument("--max-new-tokens", type=int, default=128, help="default: %(default)s")
    group.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    group.add_argument(
        "--temperature", type=float, default=1.0, help="with --do-sample (default: %(default)s)"
    )
    group.add_argument(
        "--top-k", type=int, default=None, help="with --do-sample: keep the k likeliest tokens"
    )
    group.add_argument(
        "--top-p", type=float, default=1.0, help="with --do-sample: nucleus mass (default: 1.0)"
    )
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="default: %(default)s")
    group.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    group.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop before this text (repeatable)"
    )
    group.add_argument("--system", default=None, help="system message for chat models")
    group.add_argument("--raw", action="store_true", help="do not apply the chat template")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from corolla.decoding.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def encode_prompt(tokenizer: Any, prompt: str, system: str | None, raw: bool) -> list[int]:
    if tokenizer is None:
        raise InvalidRequest("this model folder has no tokenizer, so text prompts cannot be encoded")
    if not raw and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def stream_completion(
    model: Any, input_ids: list[int], params: SamplingParams, out: TextIO
) -> tuple[str, int]:
    """Generate and print text as it arrives (never a stop string, nor half a character); returns the
    completion and the number of tokens generated."""
    from corolla.decoding.text import IncrementalText

    text = IncrementalText(model.tokenizer, params.stop, model.eos_token_ids, params.ignore_eos)
    for tokens in model.generate_stream(input_ids, params):
        out.write(text.add(int(tokens[0])))
        out.flush()
        if text.finish_reason is not None:
            break
    out.write(text.finish() + "\n")
    out.flush()
    return text.text, len(text.token_ids)


def run(args: argparse.Namespace) -> None:
    from corolla.client.model import DistributedModelForCausalLM

    if not args.initial_peers:  # alone, it would wait the routing timeout (30 s) for servers it cannot find
        raise InvalidRequest(
            "no --initial-peers: this client knows no peer to find servers through; pass the address "
            "`corolla dht` (or a server) prints, e.g. --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/Qm..."
        )
    # through `with model`: its DHT process and daemon stop too; Ctrl-C again (`timeout -s INT` signals the
    # command, then its group) is ignored while they stop, and so are the warnings of a stopping client
    exit_on(signal.SIGINT, signal.SIGTERM, signal.SIGHUP, quiet=True)
    params = sampling_params(args)
    config = client_config(args)
    model = None
    try:
        with DistributedModelForCausalLM.from_pretrained(
            args.model, dht_prefix=args.dht_prefix, config=config
        ) as model:
            generate_text(model, args, params)
    except SystemExit as e:
        if model is None:  # stopped while starting: the interpreter's exit stops what was started
            raise
        print(flush=True)  # end the line the completion stopped in
        exit_now(e.code)  # `with model` has stopped it all


def generate_text(model: Any, args: argparse.Namespace, params: SamplingParams) -> None:
    input_ids = encode_prompt(model.tokenizer, args.prompt, args.system, args.raw)
    check_length(len(input_ids), params.max_new_tokens, model.config.max_position_embeddings)
    try:
        stream_completion(model, input_ids, params, sys.stdout)
    except LengthLimit as e:  # in the words the user typed, as the API says it
        raise InvalidRequest(
            f"--max-new-tokens={params.max_new_tokens} plus the prompt's {len(input_ids)} tokens exceed "
            f"the {e.limit} tokens a session may hold on the swarm's servers (their "
            "--inference-max-length)"
        ) from None


def check_length(prompt: int, max_new_tokens: int, context: int) -> None:
    """The API's check (api/serving.py), in the CLI's words: the prompt and the new tokens fit the model."""
    if prompt >= context:
        raise InvalidRequest(f"the prompt has {prompt} tokens; this model's context is {context}")
    if prompt + max_new_tokens > context:
        raise InvalidRequest(
            f"--max-new-tokens={max_new_tokens} plus the prompt's {prompt} tokens exceed this model's "
            f"context of {context} tokens"
        )
