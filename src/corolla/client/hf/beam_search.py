"""Beam search over a session, as transformers' `generate(num_beams=N)` runs it (client/hf/generate.py).

One session of N rows: the prompt goes once per beam, then each step sends every running beam's new token
with `hypo_ids`, the beam each one continues, and the servers reorder their caches to match before the
step (the hop histories replay the same reorders after a failover). Which beams run, which finish and
when the search stops follow transformers 5's `_beam_search` (top 2N candidates, or more with several EOS
tokens; scores of finished beams divided by length ** length_penalty; its early-stop heuristic and
`early_stopping` values), computed in float32 as there, so that the same checkpoint gives the same
sequences. Greedy beams only (no beam sampling); one prompt per call (client/hf/generate.py runs the rows
of a batch one by one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from corolla.errors import InvalidRequest

if TYPE_CHECKING:
    from corolla.client.chain.session import InferenceSession
    from corolla.client.generation.head_batcher import HeadBatcher

NEVER = -1.0e9  # transformers' stand-in for minus infinity in beam scores


@dataclass(frozen=True)
class BeamSettings:
    num_beams: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    logits_processors: tuple[Any, ...] = ()
    output_scores: bool = False  # keep each step's log-probabilities (and return sequences_scores)
    output_logits: bool = False


class Beams:
    """The state of one search: running beams, the best finished ones, and whether it may stop."""

    def __init__(
        self, input_ids: torch.Tensor, max_new_tokens: int, eos: tuple[int, ...], fill: int, settings
    ):
        n = settings.num_beams
        self.settings = settings
        self.prompt_length = input_ids.shape[1]
        self.max_length = self.prompt_length + max_new_tokens
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.keep = max(2, 1 + len(eos)) * n  # candidates kept per step
        self.running = torch.full((n, self.max_length), fill, dtype=torch.long)
        self.running[:, : self.prompt_length] = input_ids[0]
        self.running_scores = torch.zeros(n)
        self.running_scores[1:] = NEVER  # the beams start equal: only the first one's continuations count
        self.sequences = self.running.clone()
        self.lengths = torch.zeros(n, dtype=torch.long)  # new tokens of each finished sequence
        self.scores = torch.full((n,), NEVER)
        # the beam each new token continued (transformers' beam_indices; -1: no token), running and finished
        self.running_indices = torch.full((n, max_new_tokens), -1, dtype=torch.int32)
        self.indices = self.running_indices.clone()
        self.step_scores: list[torch.Tensor] = []  # [N, V] log-probabilities after processors (output_scores)
        self.step_logits: list[torch.Tensor] = []  # [N, V] raw logits (output_logits)
        self.finished = torch.zeros(n, dtype=torch.bool)
        self.improvable = True  # the early-stop heuristic is not satisfied yet
        self.cur_len = self.prompt_length

    def advance(self, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One step from the running beams' log-probabilities [N, V]: returns the next tokens [N] and the
        beams they continue [N], or None when the search is over."""
        n, vocab = log_probs.shape
        total = (log_probs + self.running_scores[:, None]).reshape(-1)
        top_scores, top_indices = torch.topk(total, self.keep)
        sources = top_indices // vocab
        candidates = self.running[sources].clone()
        candidates[:, self.cur_len] = top_indices % vocab
        indices = self.running_indices[sources].clone()
        indices[:, self.cur_len - self.prompt_length] = sources.to(torch.int32)
        hits = torch.isin(top_indices % vocab, self.eos) | (self.cur_len + 1 >= self.max_length)
        running_scores = top_scores + hits.float() * NEVER
        chosen = torch.topk(running_scores, n).indices
        self.running = candidates[chosen]
        self.running_scores = running_scores[chosen]
        self.running_indices = indices[chosen]
        self._finish(candidates, indices, top_scores, hits)
        self.cur_len += 1
        self._check_heuristic()
        stop = self.settings.early_stopping is True and bool(self.finished.all())
        if not self.improvable or stop or bool(hits.all()):
            return None
        return self.running[:, self.cur_len - 1], sources[chosen]

    def _finish(
        self, candidates: torch.Tensor, indices: torch.Tensor, top_scores: torch.Tensor, hits: torch.Tensor
    ) -> None:
        settings = self.settings
        n = settings.num_beams
        just_finished = hits & (torch.arange(self.keep) < n)  # only the top N candidates may finish
        generated = self.cur_len + 1 - self.prompt_length
        scores = top_scores / (generated**settings.length_penalty)
        full = settings.early_stopping is True and bool(self.finished.all())
        scores = scores + float(full) * NEVER + float(not self.improvable) * NEVER
        scores = scores + (~just_finished) * NEVER
        merged_scores = torch.cat([self.scores, scores])
        best = torch.topk(merged_scores, n).indices
        self.sequences = torch.cat([self.sequences, candidates])[best]
        self.indices = torch.cat([self.indices, indices])[best]
        self.scores = merged_scores[best]
        self.finished = torch.cat([self.finished, just_finished])[best]
        self.lengths = torch.cat([self.lengths, torch.full((self.keep,), generated)])[best]

    def _check_heuristic(self) -> None:
        settings = self.settings
        if settings.early_stopping == "never" and settings.length_penalty > 0.0:
            best_length = self.max_length - self.prompt_length
        else:
            best_length = self.cur_len - self.prompt_length
        best_running = self.running_scores[0] / (best_length**settings.length_penalty)
        worst = torch.where(self.finished, self.scores.min(), torch.tensor(NEVER))
        self.improvable = self.improvable and bool((best_running > worst).any())

    def outputs(self) -> torch.Tensor:
        """The best `num_return_sequences` sequences [R, T + longest new]."""
        count = self.settings.num_return_sequences
        longest = int(self.lengths[:count].max())
        return self.sequences[:count, : self.prompt_length + longest]

    def output_scores(self) -> torch.Tensor:
        """[R]: the returned sequences' scores (log-probability / length ** length_penalty)."""
        return self.scores[: self.settings.num_return_sequences]

    def output_indices(self) -> torch.Tensor:
        """[R, longest new]: the beam each returned sequence's tokens continued (-1 after its end)."""
        indices = self.indices[: self.settings.num_return_sequences]
        return indices[:, : int((indices + 1).bool().sum(dim=1).max())]


async def beam_search(
    head: HeadBatcher, session: InferenceSession, input_ids: torch.Tensor, beams: Beams
) -> torch.Tensor:
    """Run `beams` from `input_ids` [1, T] on `session` (opened for N rows); returns [R, T + new]."""
    n = beams.settings.num_beams
    with torch.no_grad():
        outputs = await session.astep(head.head.embed(input_ids.expand(n, -1)))
    while True:
        logits = (await head.logits(outputs[:, -1])).float().cpu()
        log_probs = torch.log_softmax(logits, dim=-1)
        for processor in beams.settings.logits_processors:
            log_probs = processor(beams.running[:, : beams.cur_len], log_probs)
        if beams.settings.output_scores:
            beams.step_scores.append(log_probs)
        if beams.settings.output_logits:
            beams.step_logits.append(logits)
        step = beams.advance(log_probs)
        if step is None:
            return beams.outputs()
        tokens, sources = step
        with torch.no_grad():
            hidden = head.head.embed(tokens[:, None])
        outputs = await session.astep(hidden, hypo_ids=sources)


BEAM_FIELDS = ("num_beams", "length_penalty", "early_stopping", "num_return_sequences")
# what else a beam search takes: its length, which tokens end a beam and pad a row, the caller's processors
TAKEN = (
    "max_new_tokens", "eos_token_ids", "pad_token_id", "logits_processors", "speculative", "do_sample",
    "output_scores", "output_logits",
)  # fmt: skip


def beam_settings(kwargs: dict[str, Any]) -> BeamSettings | None:
    """The beam settings among `generate`'s kwargs (removed from them); None for no beam search."""
    fields = {name: kwargs.pop(name) for name in BEAM_FIELDS if name in kwargs}
    fields = {name: value for name, value in fields.items() if value is not None}
    if fields.get("num_beams", 1) == 1:
        if fields.get("num_return_sequences", 1) != 1:
            raise InvalidRequest("num_return_sequences > 1 needs num_beams >= num_return_sequences")
        return None
    others = sorted(set(kwargs) - set(TAKEN))
    if others or kwargs.get("do_sample"):
        raise InvalidRequest(f"beam search takes none of {others or ['do_sample=True']} (greedy beams only)")
    outputs = {name: bool(kwargs.get(name)) for name in ("output_scores", "output_logits")}
    settings = BeamSettings(**fields, logits_processors=kwargs.get("logits_processors", ()), **outputs)
    if not 1 <= settings.num_return_sequences <= settings.num_beams:
        raise InvalidRequest(f"num_return_sequences must lie in 1..num_beams={settings.num_beams}")
    return settings


@dataclass
class BeamResult:
    """What transformers' beam search returns (client/hf/generate.py makes its output class of it)."""

    sequences: torch.Tensor  # [B * R, T + new]
    beam_indices: torch.Tensor  # [B * R, new]: the beam (row * num_beams + beam) each token continued
    sequences_scores: torch.Tensor  # [B * R]
    scores: tuple[torch.Tensor, ...] | None = None  # one prompt only: [N, V] per step
    logits: tuple[torch.Tensor, ...] | None = None


def generate_beams(
    model: Any, input_ids: torch.Tensor, rows: list[torch.Tensor], settings: BeamSettings, kwargs: dict
) -> BeamResult:
    """Each row of `input_ids` [B, T] (its tokens without padding: `rows`) searched apart: [B * R, T + new],
    the inputs as given, then each sequence's new tokens, padded as transformers pads them."""
    if len(rows) > 1 and (settings.output_scores or settings.output_logits):
        raise InvalidRequest("output_scores and output_logits with beams take one prompt per call")
    max_new_tokens = kwargs.get("max_new_tokens", 32)
    eos = kwargs.get("eos_token_ids") or model.eos_token_ids
    pad = kwargs.get("pad_token_id", model.pad_token_id)
    fill = pad if pad else (eos[0] if eos else -1)  # transformers: `pad_token_id or eos_token_id[0]`
    searched = []
    for row in rows:
        beams = Beams(row, max_new_tokens, tuple(eos), fill, settings)

        async def search(row: torch.Tensor = row, beams: Beams = beams) -> torch.Tensor:
            session = await model.inference_session(beams.max_length).aopen()
            async with session:
                return await beam_search(model.head_batcher, session, row, beams)

        model.runtime.run(search())
        searched.append(beams)
    return _result(input_ids, searched, fill)


def _result(input_ids: torch.Tensor, searched: list[Beams], fill: int) -> BeamResult:
    per_row = searched[0].settings.num_return_sequences
    found = [beams.outputs()[:, beams.prompt_length :] for beams in searched]
    longest = max(new.shape[1] for new in found)
    width = input_ids.shape[1]
    outputs = torch.full((len(found) * per_row, width + longest), fill, dtype=torch.long)
    indices = torch.full((len(found) * per_row, longest), -1, dtype=torch.int32)
    for index, (new, beams) in enumerate(zip(found, searched, strict=True)):
        span = slice(index * per_row, (index + 1) * per_row)
        outputs[span, :width] = input_ids[index]
        outputs[span, width : width + new.shape[1]] = new
        kept = beams.output_indices()
        offset = index * beams.settings.num_beams
        indices[span, : kept.shape[1]] = torch.where(kept >= 0, kept + offset, kept)
    first = searched[0]
    return BeamResult(
        outputs,
        indices,
        torch.cat([beams.output_scores() for beams in searched]),
        tuple(first.step_scores) or None,
        tuple(first.step_logits) or None,
    )
