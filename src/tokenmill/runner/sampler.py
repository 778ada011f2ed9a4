"""Turn logits into tokens, vectorized over the batch, each row with its own parameters.

Order (as in vLLM): custom logits processors (logits_processors.py) for the requests that carry their arguments,
logit bias, allowed_token_ids, a structured output's mask and the min_tokens ban, then repetition / frequency /
presence penalties; greedy
rows take the argmax; the others are divided by their temperature, cut by top-k, top-p and min-p, and sampled
with the exponential-race trick (argmax of p / q, q ~ Exp(1)), where a seeded row draws q from its own
generator, so its tokens do not depend on what else is in the batch; or, with the engine's watermark
(watermark.py), by Gumbel-max with keyed noise from the same processed logits. Log-probabilities are those of the raw
model distribution, or, for a row that asks (processed_logprobs), of the distribution its token was drawn from.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.runner.watermark import Watermarker, reply_context
from tokenmill.sampling_params import SamplingParams, ThinkingBudget

# rows per log_softmax where only the chosen tokens' log-probabilities are wanted: bounds its [rows, V] result
LOGPROB_ROWS = 16


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence."""

    seq_id: int
    logits_row: int  # which row of the logits tensor (several samples of one prompt share a row)
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]  # EOS / stop tokens while fewer than min_tokens were generated
    seed: int | None
    allowed: torch.Tensor | None = None  # bool [vocab]: the only tokens a structured output allows next
    processors: list[Any] = field(default_factory=list)  # the custom logits processors that act on this row


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    rank: int  # rank of the sampled token in the raw distribution (1 = most likely; 0 = not computed)
    top_logprobs: list[tuple[int, float]] | None  # the `logprobs` most likely tokens, best first
    # the tokens the request's logprob_token_ids list: (id, logprob, rank), in its order
    listed_logprobs: list[tuple[int, float, int]] | None = None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] int64: the index of each row's first maximum (NaN counts as the maximum), as
    `x.argmax(dim=-1)`. On the CPU through numpy: torch's CPU argmax over a vocabulary-long row takes about
    100 us, numpy's 5, and a decode step is about 10 ms."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def is_plain_greedy(row: SamplingRow) -> bool:
    """The row's token is the argmax of its raw logits: nothing to apply, nothing to draw."""
    p = row.params
    return (
        p.greedy
        and row.allowed is None
        and p.allowed_token_ids is None
        and not p.logit_bias
        and not row.processors
        and p.thinking_budget is None
        and not row.banned_token_ids
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
    )


def _find(ids: list[int], tag: list[int], start: int = 0) -> int:
    """Where `tag` first occurs in ids[start:] (an index into ids), or -1."""
    for at in range(start, len(ids) - len(tag) + 1):
        if ids[at : at + len(tag)] == tag:
            return at
    return -1


def budget_token(budget: ThinkingBudget, output: list[int]) -> int | None:
    """The token a reply must take next because its thinking budget is spent (the next one of the closing tag),
    or None: not thinking (yet, or any more), or within the budget."""
    start = 0
    if budget.start_ids is not None:
        opened = _find(output, budget.start_ids)
        if opened == -1:
            return None
        start = opened + len(budget.start_ids)
    if _find(output, budget.end_ids, start) != -1 or len(output) - start < budget.tokens:
        return None
    written = next((k for k in range(len(budget.end_ids) - 1, 0, -1) if output[-k:] == budget.end_ids[:k]), 0)
    return budget.end_ids[written]


class Sampler:
    def __init__(
        self, device: torch.device, processors: list[Any] | None = None, watermarker: Watermarker | None = None
    ):
        self.device = device
        self.processors = processors or []  # custom logits processors (logits_processors.py)
        self.watermarker = watermarker  # the engine's watermark_config, a stage of the random draws
        self._generators: dict[int, torch.Generator] = {}
        self._unseeded = torch.Generator(device=device)
        self._unseeded.seed()

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        if self.watermarker is not None:
            self.watermarker.release(seq_id)

    def _generator(self, row: SamplingRow) -> torch.Generator:
        if row.seed is None:
            return self._unseeded
        gen = self._generators.get(row.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(row.seed % (2**64))
            self._generators[row.seq_id] = gen
        return gen

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """logits [num_logits_rows, vocab] float32 -> one SampledToken per row of `rows`."""
        in_order = len(rows) == logits.shape[0] and all(r.logits_row == i for i, r in enumerate(rows))
        if in_order:
            raw = logits.float()  # [R, V]
        else:
            raw = logits.index_select(0, torch.tensor([r.logits_row for r in rows], device=logits.device)).float()
        if all(is_plain_greedy(r) and not r.params.processed_logprobs for r in rows):  # the common decode case:
            return self._logprobs(raw, argmax_rows(raw), rows)  # nothing to apply, nothing to draw
        processed = self._apply_biases_and_penalties(raw.clone(), rows)
        tokens = torch.empty(len(rows), dtype=torch.int64, device=raw.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        drawn_from: dict[int, torch.Tensor] = {}  # row -> the probabilities its token was drawn from, if asked
        if greedy:
            g = torch.tensor(greedy, device=raw.device)
            tokens[g] = argmax_rows(processed[g])
        if random:
            rnd = torch.tensor(random, device=raw.device)
            tokens[rnd], probs = self._sample_random(processed[rnd], [rows[i] for i in random])
            drawn_from = {i: probs[j] for j, i in enumerate(random) if rows[i].params.processed_logprobs}
        for i in greedy:
            if rows[i].params.processed_logprobs:  # all its probability on the one token it takes
                drawn_from[i] = torch.zeros_like(raw[i]).index_fill_(0, tokens[i : i + 1], 1.0)
        if not drawn_from:
            return self._logprobs(raw, tokens, rows)
        logprobs = raw.log_softmax(dim=-1)
        for i, probs in drawn_from.items():
            logprobs[i] = (probs / probs.sum()).log()
        return self._logprobs(logprobs, tokens, rows)

    def _apply_biases_and_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, r in enumerate(rows):
            for processor in r.processors:
                logits[i] = processor(r.params, r.prompt_token_ids, r.output_token_ids, logits[i])
        bias_rows, bias_cols, bias_vals = [], [], []
        for i, r in enumerate(rows):
            for token, value in (r.params.logit_bias or {}).items():
                bias_rows.append(i)
                bias_cols.append(token)
                bias_vals.append(value)
        if bias_rows:
            logits.index_put_(
                (torch.tensor(bias_rows, device=logits.device), torch.tensor(bias_cols, device=logits.device)),
                torch.tensor(bias_vals, dtype=logits.dtype, device=logits.device),
                accumulate=True,
            )
        forcing = set()
        for i, r in enumerate(rows):  # a thinking budget spent: the tag that ends the thinking, token by token
            forced = budget_token(r.params.thinking_budget, r.output_token_ids) if r.params.thinking_budget else None
            if forced is not None:
                forcing.add(i)
                keep = logits[i, forced].clone()
                logits[i].fill_(float("-inf"))
                logits[i, forced] = keep if bool(torch.isfinite(keep)) else 0.0
        # the masks: a structured output's constraint, and allowed_token_ids (within the constraint's, where that
        # leaves any; a spent thinking budget's tag wins over it)
        constrained = {i: r.allowed.to(logits.device) for i, r in enumerate(rows) if r.allowed is not None}
        for i, r in enumerate(rows):
            if r.params.allowed_token_ids is not None and i not in forcing:
                listed = _token_mask(r.params.allowed_token_ids, logits.shape[-1], logits.device)
                both = listed & constrained[i] if i in constrained else listed
                if i not in constrained or bool(both.any()):
                    constrained[i] = both
        for i, allowed in constrained.items():
            logits[i].masked_fill_(~allowed, float("-inf"))
        before_bans = {i: logits[i].clone() for i in constrained if rows[i].banned_token_ids}
        ban_rows = [i for i, r in enumerate(rows) for _ in r.banned_token_ids]
        ban_cols = [t for r in rows for t in r.banned_token_ids]
        if ban_rows:
            logits[torch.tensor(ban_rows, device=logits.device), torch.tensor(ban_cols, device=logits.device)] = float(
                "-inf"
            )
        for i, row in before_bans.items():
            if not bool(torch.isfinite(logits[i]).any()):  # min_tokens banned all the mask allows: the mask wins
                logits[i] = row

        # penalties touch only the tokens a row has seen: O(prompt + output) per row, not O(vocabulary)
        dev = logits.device
        for i, r in enumerate(rows):
            p = r.params
            if p.repetition_penalty != 1.0:  # every token of the prompt or output: positive logits / p, others * p
                seen = torch.tensor(r.prompt_token_ids + r.output_token_ids, dtype=torch.int64, device=dev).unique()
                values = logits[i, seen]
                rep = p.repetition_penalty
                # a banned or disallowed token (-inf) stays so, and a logit stays finite: with a penalty that rounds
                # to 0 in float32 (the smallest doubles do) -inf * 0 was NaN, which argmax picked, and x / 0 was
                # inf, which made softmax NaN (schemathesis: repetition_penalty 5e-324)
                penalized = torch.where(values > 0, values / rep, values * rep).clamp(max=torch.finfo(logits.dtype).max)
                logits[i, seen] = torch.where(values == float("-inf"), values, penalized)
            if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and r.output_token_ids:
                out_ids = torch.tensor(r.output_token_ids, dtype=torch.int64, device=dev)
                tokens, counts = out_ids.unique(return_counts=True)  # occurrences in the generated text
                logits[i, tokens] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
        return logits

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the drawn tokens, the probabilities they were drawn from: unnormalized where min-p cut some)."""
        dev = logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], device=dev).unsqueeze(1)
        logits = (logits / temperature).clamp(max=torch.finfo(logits.dtype).max)  # a huge logit / 0.2: not inf
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=dev).unsqueeze(1)
            remove = ranks >= k
            probs_sorted = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            cumulative = probs_sorted.cumsum(dim=-1)
            p = torch.tensor(top_p, device=dev).unsqueeze(1)
            remove |= (cumulative - probs_sorted) >= p  # keep the smallest prefix whose mass reaches p
            remove[:, 0] = False
            logits = torch.full_like(logits, float("-inf")).scatter(
                -1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf"))
            )
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([r.params.min_p for r in rows], device=dev).unsqueeze(1)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs)
        for i, r in enumerate(rows):
            noise[i].exponential_(generator=self._generator(r))
        tokens = argmax_rows(probs / noise)
        if self.watermarker is not None:
            _watermark(self.watermarker, tokens, logits.masked_fill(probs == 0, float("-inf")), rows, self._generator)
        return tokens, probs

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        # the sampled token's log-probability always (for cumulative_logprob); ranks, top-k and the listed tokens'
        # (logprob_token_ids) only when asked
        # log_softmax, never logsumexp: torch's softmax over the last dimension computes each row on its own, where
        # logsumexp's reduction splits a row's sum by the row count (a row's log-probability moved in its last bit
        # with the batch)
        max_k = max((r.params.logprobs if r.params.logprobs is not None else -1) for r in rows)
        listing = any(r.params.logprob_token_ids for r in rows)
        token_list = tokens.tolist()
        picked = tokens.unsqueeze(1)  # [R, 1]
        if max_k < 0 and not listing:
            chosen = torch.cat(
                [
                    raw[s : s + LOGPROB_ROWS].log_softmax(dim=-1).gather(1, picked[s : s + LOGPROB_ROWS])
                    for s in range(0, raw.shape[0], LOGPROB_ROWS)
                ]
            )  # [R, 1]
            return [SampledToken(t, lp, 0, None) for t, lp in zip(token_list, chosen.squeeze(1).tolist(), strict=True)]
        logprobs = raw.log_softmax(dim=-1)  # [R, V]
        chosen_column = logprobs.gather(1, picked)  # [R, 1]
        chosen = chosen_column.squeeze(1).tolist()
        ranks = ((logprobs > chosen_column).sum(dim=-1) + 1).tolist()
        top_ids: list[list[int]] = [[] for _ in rows]
        top_vals: list[list[float]] = [[] for _ in rows]
        if max_k >= 0:
            values, ids = logprobs.topk(max(max_k, 1), dim=-1)
            top_vals, top_ids = values.tolist(), ids.tolist()
        out = []
        for i, r in enumerate(rows):
            k = r.params.logprobs
            top = None if k is None else list(zip(top_ids[i][:k], top_vals[i][:k], strict=True))
            if top is not None and r.params.processed_logprobs:  # what it could not draw is no candidate
                top = [(t, v) for t, v in top if v != float("-inf")]
            sampled = SampledToken(token_list[i], chosen[i], ranks[i], top)
            if r.params.logprob_token_ids:
                sampled.listed_logprobs = listed_logprobs(logprobs[i], r.params.logprob_token_ids)
            out.append(sampled)
        return out


def _watermark(
    marker: Watermarker,
    tokens: torch.Tensor,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    generator: Callable[[SamplingRow], torch.Generator],
) -> None:
    """Redraw the watermarked rows' tokens from their processed logits [R, V] (-inf: cannot be drawn) with the
    watermark's keyed noise; the others (opted out, or a context seen before) keep their ordinary draw."""
    marked = [
        i
        for i, r in enumerate(rows)
        if marker.marks(r.params) and not marker.repeated(r.seq_id, r.prompt_token_ids, r.output_token_ids)
    ]
    if not marked:
        return
    width = marker.config.context_width
    contexts = torch.tensor(
        [reply_context(rows[i].output_token_ids, width) for i in marked], dtype=torch.int64, device=logits.device
    )
    keys = [marker.key_for(generator(rows[i]), logits.device) for i in marked]
    index = torch.tensor(marked, device=logits.device)
    tokens[index] = marker.sample(logits[index], contexts, keys)


def listed_logprobs(logprobs: torch.Tensor, token_ids: list[int]) -> list[tuple[int, float, int]]:
    """One position's log-probabilities [V] at these tokens: (id, logprob, rank), in the order given."""
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device)
    values = logprobs.index_select(0, ids)
    ranks = ((logprobs.unsqueeze(0) > values.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    return list(zip(token_ids, values.tolist(), ranks, strict=True))


def _token_mask(token_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """bool [vocab]: True at these tokens."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[torch.tensor(token_ids, dtype=torch.int64, device=device)] = True
    return mask


def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], k: int) -> list[tuple[float, int, list]]:
    """Logits after each prompt position [N, V] and the prompt tokens that follow them -> per position:
    (logprob of the actual next token, its rank, top-k [(id, logprob)])."""
    logprobs = logits.float().log_softmax(dim=-1)
    target = torch.tensor(next_token_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, target.unsqueeze(1)).squeeze(1)
    ranks = ((logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    tops: list[list] = [[] for _ in next_token_ids]
    if k > 0:
        vals, ids = logprobs.topk(k, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return [(c, r, t) for c, r, t in zip(chosen.tolist(), ranks, tops, strict=True)]
