"""What transformers' `generate` takes, on corolla's generation loop (client/model.py `generate`).

- `attention_mask` [B, T]: rows padded on the left or on the right. Each row runs as its own sequence
  without its padding (a session of its own, all rows at once), so a padded row gets exactly the tokens
  it gets alone; the result keeps transformers' layout: the input rows as given, then each row's new
  tokens, then `pad_token_id` after a row that ended early. A mask of ones is no padding at all.
- `streamer`: transformers' streamers (`TextStreamer`, `TextIteratorStreamer`, any `BaseStreamer`) get
  the prompt first, then each step's tokens, then `end()`, which is called even when the generation
  fails, so a reader of a `TextIteratorStreamer` never waits forever. A plain callable gets each step's
  tokens, as before.
- transformers' names for corolla's parameters: `max_length` (prompt included), `stop_strings` (matched
  with the `tokenizer` given, as transformers requires one there; else the model folder's),
  `eos_token_id`, `pad_token_id`, `logits_processor` and `stopping_criteria` (lists of transformers'
  callables, run as its generate runs custom ones); a `generation_config`, else the checkpoint's
  generation_config.json, under the call's own kwargs (as transformers has it). `num_beams` > 1 runs
  client/hf/beam_search.py; settings corolla cannot honour are refused by name (a checkpoint's own are
  logged and ignored).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import GenerationConfig

from corolla.client.hf.beam_search import BEAM_FIELDS, beam_settings, generate_beams
from corolla.client.hf.outputs import StepRecord, beam_output, decoder_output, merge_rows
from corolla.decoding.sampling import SamplingParams
from corolla.errors import InvalidRequest

logger = logging.getLogger(__name__)

# GenerationConfig fields `generate` honours (as transformers does) and fields that change nothing here
SETTINGS = (
    "max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
    "stop_strings", "eos_token_id", "pad_token_id", "num_beams", "length_penalty", "early_stopping",
    "num_return_sequences", "return_dict_in_generate", "output_scores", "output_logits",
)  # fmt: skip
IGNORED_SETTINGS = {
    "transformers_version", "_from_model_config", "use_cache", "bos_token_id", "output_attentions",
    "output_hidden_states",
}  # fmt: skip
REMOTE_OUTPUTS = ("output_attentions", "output_hidden_states")  # the servers keep these
# what `generate` takes once in SamplingParams' names
ACCEPTED = {f.name for f in fields(SamplingParams)} | set(BEAM_FIELDS) | {"return_dict_in_generate"}

if TYPE_CHECKING:
    from corolla.client.chain.session import InferenceSession
    from corolla.client.runtime import LoopThread
    from corolla.decoding.chooser import GenerationStep


class GeneratingModel(Protocol):
    """What these functions use of `DistributedModelForCausalLM` (client/model.py)."""

    runtime: LoopThread
    pad_token_id: int
    generation_config: GenerationConfig

    def agenerate_steps(
        self,
        input_ids: torch.Tensor,
        params: SamplingParams | None,
        session: InferenceSession | None = None,
        withdrawals: str = "redo",
        tokenizer: Any = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationStep]: ...


def unpadded_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor] | None:
    """Each row's tokens [1, T_i] without its padding; None when nothing is padded."""
    if attention_mask is None:
        return None
    mask = torch.as_tensor(attention_mask)
    if mask.dim() == 1:
        mask = mask[None]
    if mask.shape != input_ids.shape:
        raise InvalidRequest(
            f"attention_mask must have the shape of input_ids {list(input_ids.shape)}, got {list(mask.shape)}"
        )
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise InvalidRequest("attention_mask must hold only 0 (padding) and 1 (a token)")
    mask = mask.bool()
    if bool(mask.all()):
        return None
    rows = []
    for index, (ids, keep) in enumerate(zip(input_ids, mask, strict=True)):
        kept = keep.nonzero().flatten()
        if not len(kept):
            raise InvalidRequest(f"attention_mask row {index} masks every token: nothing to continue")
        if int(kept[-1] - kept[0]) + 1 != len(kept):
            raise InvalidRequest(
                f"attention_mask row {index} has padding between tokens: pad on the left or on the right only"
            )
        rows.append(ids[keep][None])
    return rows


def transformers_names(
    input_ids: torch.Tensor, kwargs: dict[str, Any], defaults: GenerationConfig | None = None
) -> dict[str, Any]:
    """kwargs in SamplingParams' names: a `generation_config` (else `defaults`, the checkpoint's) under
    the caller's own kwargs, and transformers' names (max_length, stop_strings, eos_token_id, ...)."""
    kwargs = dict(kwargs)
    config = kwargs.pop("generation_config", None)
    if config is not None and not isinstance(config, GenerationConfig):
        raise InvalidRequest(f"generation_config must be a transformers GenerationConfig, got {type(config)}")
    chosen = config if config is not None else defaults
    kwargs = {**({} if chosen is None else settings(chosen, strict=config is not None)), **kwargs}
    max_length = kwargs.pop("max_length", None)
    if max_length is not None and "max_new_tokens" not in kwargs:
        if max_length <= input_ids.shape[1]:
            raise InvalidRequest(
                f"max_length={max_length} leaves no room after the {input_ids.shape[1]} input tokens "
                "(max_length counts the prompt; max_new_tokens does not)"
            )
        kwargs["max_new_tokens"] = max_length - input_ids.shape[1]
    stop_strings = kwargs.pop("stop_strings", None)
    if stop_strings is not None:
        kwargs["stop"] = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
    for name, field in (
        ("logits_processor", "logits_processors"),
        ("stopping_criteria", "stopping_criteria"),
    ):
        callables = kwargs.pop(name, None)
        if callables:  # a processor may keep state: no speculation, whose drafts it would see and forget
            kwargs[field] = tuple(callables)
            kwargs["speculative"] = False
    eos = kwargs.pop("eos_token_id", None)
    if eos is not None:
        kwargs["eos_token_ids"] = (eos,) if isinstance(eos, int) else tuple(eos)
    return checked_names(kwargs)


def checked_names(kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs without transformers' settings that change nothing here; any other unknown name refused."""
    for name in IGNORED_SETTINGS:
        if kwargs.pop(name, None) and name in REMOTE_OUTPUTS:
            raise InvalidRequest(
                f"{name}: the blocks run on servers, which send no attentions or hidden states"
            )
    unknown = sorted(set(kwargs) - ACCEPTED)
    if unknown:
        raise InvalidRequest(f"generate does not take {', '.join(unknown)}")
    return kwargs


def settings(config: GenerationConfig, strict: bool) -> dict[str, Any]:
    """What a GenerationConfig sets, in transformers' names that `generate` takes. `strict` (a config the
    caller passed): a setting corolla cannot honour is an error; in a checkpoint's, it is logged."""
    fields = {
        name: value
        for name, value in config.to_diff_dict().items()
        if value is not None and name not in IGNORED_SETTINGS
    }
    unknown = sorted(set(fields) - set(SETTINGS))
    if unknown and strict:
        raise InvalidRequest(f"generation_config sets {', '.join(unknown)}: generate does not take these yet")
    if unknown:
        logger.warning("Ignoring the checkpoint's generation settings %s (not supported)", ", ".join(unknown))
    return {name: value for name, value in fields.items() if name in SETTINGS}


@dataclass
class Streamer:
    """Where `generate` reports tokens: a transformers streamer (put/end) or a callable, or nowhere."""

    put: Callable[[torch.Tensor], Any] | None = None
    end: Callable[[], Any] | None = None

    @classmethod
    def of(cls, streamer: Any, input_ids: torch.Tensor) -> Streamer:
        if streamer is None:
            return cls()
        if hasattr(streamer, "put") and hasattr(streamer, "end"):
            streamer.put(input_ids)  # transformers' streamers take the prompt first (skip_prompt drops it)
            return cls(streamer.put, streamer.end)
        if not callable(streamer):
            raise InvalidRequest(
                f"streamer must be a transformers streamer (put and end) or a callable, got {type(streamer)}"
            )
        return cls(streamer)

    def step(self, tokens: torch.Tensor) -> None:
        if self.put is not None:
            self.put(tokens)

    def close(self) -> None:
        if self.end is not None:
            self.end()


async def generate_rows(
    model: GeneratingModel, rows: list[torch.Tensor], params: SamplingParams, tokenizer: Any = None
) -> list[StepRecord]:
    """Each row's steps, every row its own generation, all at once (a seed is varied per row)."""

    async def one(index: int, row: torch.Tensor) -> StepRecord:
        seed = None if params.seed is None else params.seed + index
        record = StepRecord()
        async for step in model.agenerate_steps(row, params, None, "redo", tokenizer, seed=seed):
            record.add(step)  # a step withdrawn by a spot check (a lying server) is redone
        return record

    return list(await asyncio.gather(*(one(index, row) for index, row in enumerate(rows))))


def generate(
    model: GeneratingModel,
    input_ids: torch.Tensor,
    params: SamplingParams | None,
    session: InferenceSession | None,
    streamer: Any,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> Any:
    """`DistributedModelForCausalLM.generate`: [B, T] -> [B, T + new], or transformers' output with
    return_dict_in_generate (client/hf/outputs.py)."""
    kwargs = dict(kwargs)
    tokenizer = kwargs.pop("tokenizer", None)  # what stop strings are matched with (transformers' name)
    kwargs = transformers_names(input_ids, kwargs, None if params is not None else model.generation_config)
    as_dict = kwargs.pop("return_dict_in_generate", False)
    rows = unpadded_rows(input_ids, attention_mask)
    beams = beam_settings(kwargs)
    if beams is not None:
        if session is not None or streamer is not None:
            raise InvalidRequest("beam search takes neither a session nor a streamer (as in transformers)")
        every_row = rows if rows is not None else [row[None] for row in input_ids]
        found = generate_beams(model, input_ids, every_row, beams, kwargs)
        return beam_output(found, beams.output_scores) if as_dict else found.sequences
    if rows is not None and (session is not None or (len(rows) > 1 and streamer is not None)):
        raise InvalidRequest(
            "a padded batch (attention_mask with zeros) runs each row apart: it takes no session, and a "
            "streamer only with one row (as transformers' streamers)"
        )
    record = StepRecord()
    stream = Streamer.of(streamer, input_ids)
    try:
        if rows is not None and len(rows) > 1:
            params = replace(params or SamplingParams(), **kwargs)
            pad = model.pad_token_id if params.pad_token_id is None else params.pad_token_id
            record = merge_rows(model.runtime.run(generate_rows(model, rows, params, tokenizer)), pad)
        else:
            prompt = input_ids if rows is None else rows[0]
            steps = model.agenerate_steps(prompt, params, session, "redo", tokenizer, **kwargs)
            for step in model.runtime.iterate(steps):
                record.add(step)  # a step withdrawn by a spot check (a lying server) is redone
                if not step.withdrawn:
                    stream.step(step.tokens)
    finally:
        stream.close()
    sequences = record.sequences(input_ids)
    return decoder_output(sequences, record) if as_dict else sequences
