"""`DistributedModelForCausalLM`: a causal LM whose transformer blocks run on the swarm.

The client loads only the embeddings, final norm and LM head; every block runs on servers found through
the DHT. One model object serves any number of concurrent sessions, from threads (synchronous methods)
or from its own event loop (the `a*` coroutines). It is the facade of the whole client, one class with
transformers' entry points (loading, generation, sessions, forward, embeddings) whose work lives in the
modules below it: that is why it runs over 300 lines.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any

import torch
from transformers import GenerationConfig

from corolla.client.chain.session import InferenceSession
from corolla.client.client import Client, ServedModel
from corolla.client.generation.head_batcher import HeadBatcher
from corolla.client.generation.loop import Withdrawals, first_step, generate_steps
from corolla.client.generation.prefixes import Opened
from corolla.client.hf import generate as hf_generate
from corolla.client.hf.transformers_model import TransformersModel
from corolla.client.runtime import LoopThread
from corolla.client.training.embeddings import Pooling, embed_sequences
from corolla.client.training.lm_outputs import CausalLMOutput, causal_lm_output, chain_inputs
from corolla.client.training.ptune import PromptTuning
from corolla.client.training.remote_chain import RemoteChain
from corolla.config import ClientConfig
from corolla.decoding.chooser import Chooser, GenerationStep, RowEnds
from corolla.decoding.sampling import SamplingParams
from corolla.decoding.speculator import Speculator
from corolla.errors import InvalidRequest
from corolla.models.head import ModelHead
from corolla.models.model_config import ModelConfig, parse_dtype
from corolla.models.source import ModelSource, dht_prefix_for, resolve_model
from corolla.swarm.dht import spawn_dht


class DistributedModelForCausalLM(TransformersModel):
    def __init__(
        self,
        source: ModelSource,
        config: ModelConfig,
        head: ModelHead,
        client: Client,
        runtime: LoopThread,
        ptune: PromptTuning | None = None,
        speculator: Speculator | None = None,
    ):
        """`client` runs on `runtime`'s loop; `ptune`: trainable prompts (tuning_mode); `speculator`:
        speculative decoding (ClientConfig.speculation)."""
        self.source = source
        self.model_config = config  # corolla's view of it (models/model_config.py)
        self.head = head
        self.client = client
        self.runtime = runtime
        self.head_batcher = HeadBatcher(head)
        self.ptune = ptune
        self.speculator = speculator

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        initial_peers: Sequence[str] = (),
        *,
        dht_prefix: str | None = None,
        config: ClientConfig | None = None,
        tuning_mode: str | None = None,
        pre_seq_len: int = 0,
        **overrides: Any,
    ) -> DistributedModelForCausalLM:
        """Load the local parts of `model` and join the swarm through `initial_peers`.

        `tuning_mode` "ptune" adds `pre_seq_len` trainable input embeddings, "deep_ptune" also a trainable
        prompt per block (see client/training/ptune.py). `overrides` are ClientConfig fields (request_timeout,
        routing_timeout, allowed_servers, speculation, ...).
        """
        config = replace(config or ClientConfig(), **overrides)
        if initial_peers:
            config = replace(config, swarm=replace(config.swarm, initial_peers=tuple(initial_peers)))
        source = resolve_model(model)
        model_config = ModelConfig.from_folder(source.path)
        prefix = dht_prefix or config.dht_prefix or dht_prefix_for(source.name)
        # join the swarm (and read it) while the local parts load: both take about a second; the DHT
        # peer's process is forked first, before this thread loads anything (swarm/dht.py Spawning)
        spawning = spawn_dht(config.swarm)
        runtime = LoopThread()
        joining = runtime.submit(Client.connect(config, prefix, ServedModel.of(model_config), spawning))
        try:
            head = ModelHead.load(source.path, parse_dtype(config.dtype, model_config))
            ptune = None
            if tuning_mode is not None:
                layers = model_config.num_hidden_layers
                ptune = PromptTuning(tuning_mode, pre_seq_len, layers, head.embed_tokens)
            speculation = config.speculation
            speculator = speculation and Speculator.create(speculation, model_config, source.path, head)
            client = joining.result()
        except BaseException:
            runtime.stop_after(joining, Client.shutdown)
            raise
        return cls(source, model_config, head, client, runtime, ptune, speculator)

    # --- tokenizer and special tokens ----------------------------------------------------------------------

    @cached_property
    def tokenizer(self) -> Any:
        """The model folder's tokenizer (transformers' AutoTokenizer), or None if the folder has none."""
        return self.source.load_tokenizer()

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.source.eos_token_ids(self.model_config.eos_token_ids)

    @cached_property
    def generation_config(self) -> GenerationConfig:
        """The checkpoint's generation_config.json (transformers' GenerationConfig): `generate`'s defaults."""
        return self.source.generation_config()

    @property
    def pad_token_id(self) -> int:
        if self.model_config.pad_token_id is not None:
            return self.model_config.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    # --- inference -----------------------------------------------------------------------------------------

    def inference_session(
        self,
        max_length: int,
        alloc_timeout: float = 0.0,
        servers: Sequence[str] | None = None,
        keep: bool = False,
    ) -> InferenceSession:
        """A session that keeps server-side caches across calls; use it as a context manager. `servers`:
        route it only through these peer ids; `keep`: its servers keep it for forks once it ends."""
        keep_outputs = self.client.checker is not None  # spot checks compare each hop's outputs
        return InferenceSession(
            self.client.swarm, self.runtime, max_length, alloc_timeout, servers, keep_outputs, keep
        )

    async def agenerate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        params: SamplingParams | None = None,
        session: InferenceSession | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[torch.Tensor]:
        """Yield each step's new tokens [B]; kwargs are SamplingParams fields. Tokens a spot check finds
        wrong cannot be taken back here: ServerUnavailable (`generate` replaces them)."""
        async for step in self.agenerate_steps(input_ids, params, session, withdrawals="fail", **kwargs):
            yield step.tokens

    async def agenerate_steps(
        self,
        input_ids: torch.Tensor | Sequence[int],
        params: SamplingParams | None = None,
        session: InferenceSession | None = None,
        withdrawals: Withdrawals = "redo",
        tokenizer: Any = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationStep]:
        """Like `agenerate`, with each row's finished flag, (params.logprobs) log-probabilities, and the
        chain of servers its session stood on (`route`). Without `session`, one is opened for max_length =
        prompt + max_new_tokens (+ the trained prefix) and closed on every server of its chain as soon as
        the generation ends, fails or is cancelled. With a tuning_mode, a new session starts with the
        trained prompts, as `forward` uses them. With a drafter (ClientConfig.speculation) and
        params.speculative, a one-row generation drafts and verifies several tokens per step: the tokens
        are the same. Tokens a spot check finds wrong are withdrawn by a step with `withdrawn` set and
        chosen again ("redo"), or end the generation with ServerUnavailable ("fail"). `tokenizer`: what
        stop strings and grammars are matched with (default: the model folder's).
        """
        input_ids = _as_batch(input_ids)
        params = replace(params or SamplingParams(), **kwargs)
        own = session is None
        opened = await self._open(input_ids, params) if own else await self._adopt(session, input_ids)
        session = opened.session
        held = opened.start
        ended = None  # the tokens its servers hold, once it ended well
        try:
            tuned = self._tuned(session, input_ids)
            first = first_step(self.head_batcher, session, input_ids, params, tuned, held or 0)
            chooser = self._chooser(input_ids, params, tokenizer)
            speculation = None
            if self.speculator is not None and params.speculative and input_ids.shape[0] == 1:
                speculation = self.speculator.start(session.max_length)
            checker = self.client.checker
            steps = generate_steps(
                self.head_batcher, session, chooser, first, speculation, checker, withdrawals
            )
            async for step in steps:
                cached = None
                if held is not None and not step.withdrawn:
                    cached = opened.cached
                    opened.prompt_ran()
                    held = None
                yield replace(step, cached_tokens=cached, route=tuple(session.route))
            ended = chooser.context[0, : session.settled_position]
        finally:
            if own:
                await session.aclose()
                if self.client.prefixes is not None:
                    self.client.prefixes.ended(opened, ended)

    async def _adopt(self, session: InferenceSession, input_ids: torch.Tensor) -> Opened:
        """A user's session at its first generation: moved onto the servers holding the longest prefix of its
        one prompt row (client/generation/prefixes.py), when reuse is on and it has sent nothing yet."""
        prefixes = self.client.prefixes
        if prefixes is None or self.ptune is not None or input_ids.shape[0] != 1 or not session.fresh:
            return Opened(session)
        return await prefixes.adopt(session, input_ids)

    async def _open(self, input_ids: torch.Tensor, params: SamplingParams) -> Opened:
        """A generation's own session, from the longest prefix the servers hold
        (client/generation/prefixes.py) when reuse is on and its rows are one prompt (trained prompts:
        never)."""
        prefix = 0 if self.ptune is None else self.ptune.pre_seq_len
        length = prefix + input_ids.shape[1] + params.max_new_tokens
        prefixes = self.client.prefixes
        if prefixes is None or self.ptune is not None or not bool((input_ids == input_ids[0]).all()):
            return Opened(await self.inference_session(length).aopen())

        def make(max_length: int, keep: bool) -> InferenceSession:
            return self.inference_session(max_length, keep=keep)

        return await prefixes.open(make, input_ids, length, self.head.embed)

    def _chooser(self, input_ids: torch.Tensor, params: SamplingParams, tokenizer: Any = None) -> Chooser:
        if not (params.stop or params.grammar):
            tokenizer = None
        elif tokenizer is None:  # the caller's, else the model folder's
            tokenizer = self.tokenizer
        eos = self.eos_token_ids if params.eos_token_ids is None else params.eos_token_ids
        ends = RowEnds(params, eos, tokenizer, input_ids.shape[0])
        pad = self.pad_token_id if params.pad_token_id is None else params.pad_token_id
        return Chooser(params, ends, pad, input_ids)

    def _tuned(self, session: InferenceSession, input_ids: torch.Tensor) -> tuple | None:
        """The trained prompts a generation starts with: (input prefix [B, P, H], deep prompts or None),
        for a session that has not begun; None without a tuning_mode."""
        if self.ptune is None or session.position > 0:
            return None
        deep = self.ptune.block_prompts().detach()
        return self.ptune.prefix(input_ids.shape[0]).detach(), deep if deep.numel() else None

    def generate_stream(
        self,
        input_ids: torch.Tensor | Sequence[int],
        params: SamplingParams | None = None,
        session: InferenceSession | None = None,
        **kwargs: Any,
    ) -> Iterator[torch.Tensor]:
        """A synchronous iterator over each step's new tokens [B], yielded as soon as they are sampled.

        Tokens, as transformers' `generate(stop_strings=...)` has them: a `stop` string ends a row with the
        token that completes it, which is yielded (the API and the CLI cut the text before it)."""
        yield from self.runtime.iterate(self.agenerate(input_ids, params, session, **kwargs))

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        params: SamplingParams | None = None,
        session: InferenceSession | None = None,
        streamer: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Generate like transformers' `generate`: returns [B, T + new] (inputs followed by new tokens).

        kwargs are SamplingParams fields (max_new_tokens, do_sample, temperature, top_k, top_p,
        repetition_penalty, seed, stop, ignore_eos) or transformers' max_length and stop_strings (with
        `tokenizer=`, as transformers takes it: what they are matched with; else the model folder's).
        `attention_mask`: padded rows (left or right) each run without their padding, and get exactly the
        tokens they get alone. `streamer`: a transformers streamer or a callable of each step's tokens [B]
        (client/hf/generate.py).
        """
        ids = _as_batch(input_ids)
        return hf_generate.generate(self, ids, params, session, streamer, attention_mask, kwargs)

    # --- forward pass --------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        """Logits for every position of input_ids [B, T] (one pass through the swarm, no cache).

        Differentiable: with grad enabled, `loss.backward()` (or `logits`' gradients) flows through every
        server's blocks (rpc_backward) to the trainable prompts and any client parameter that requires
        grad (`model.head.requires_grad_(True)` trains the embeddings and LM head). With `labels` [B, T]
        (-100 = ignored; pad on the right), `loss` is the next-token cross-entropy.
        """
        input_ids = _as_batch(input_ids)
        hidden, prompts = chain_inputs(self.head, self.ptune, input_ids)
        if torch.is_grad_enabled() and (hidden.requires_grad or prompts.requires_grad):
            outputs = RemoteChain.apply(hidden, prompts, self.client.passes, self.runtime)
        else:
            with torch.no_grad():
                deep = prompts if prompts.numel() else None
                outputs = self.runtime.run(self.client.passes.forward(hidden, deep))[0]
        return causal_lm_output(self.head, self.ptune, outputs, labels)

    __call__ = forward

    async def aembed(self, sequences: list[list[int]], pooling: Pooling = "mean") -> torch.Tensor:
        """Unit vectors [N, hidden] (float32) of sequences of token ids (client/training/embeddings.py), on
        the model's loop."""
        if self.ptune is not None:
            raise InvalidRequest("embeddings of a model with trained prompts are not supported")
        return await embed_sequences(self.client.passes, self.head, self.pad_token_id, sequences, pooling)

    def parameters(self) -> list[torch.nn.Parameter]:
        """What training can update: the trainable prompts and the head's parameters that require grad."""
        params = [p for p in self.head.parameters() if p.requires_grad]
        if self.ptune is not None:
            params += list(self.ptune.parameters())
        return params

    # --- lifetime ------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self.head_batcher.shutdown()
        if self.speculator is not None:
            self.speculator.shutdown()
        if self.runtime.loop.is_running():
            self.runtime.run(self.client.shutdown())
        self.runtime.stop()

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_batch(input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    ids = (
        input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(list(input_ids), dtype=torch.long)
    )
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype not in (torch.int64, torch.int32):
        raise InvalidRequest(
            f"input_ids must be a non-empty integer tensor [batch, length], got {ids.dtype} {list(ids.shape)}"
        )
    return ids.long()
