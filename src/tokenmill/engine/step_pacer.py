"""How many prompt tokens a step may carry while more than one call has work (scheduler.py, rule 3).

A step's time grows with its tokens: on a 2-core CPU 512 prompt tokens of the 135M model take about a second, so a
stream whose decode shares each step with another call's prompt chunks (a 2,048-input embedding call, a long
document) would get one token a second. The pacer keeps those steps near `target_ms`. A step costs a fixed part
(the weights read once, Python, sampling: what a step of decodes alone takes) plus a part per token; it learns both
as exponential averages (so it follows a machine whose speed drifts or whose cores are shared), the fixed part from
the small steps and the cost of a token from what the large ones took beyond it, and gives the scheduler the tokens
that fit beside the fixed part, at least one KV block's worth so every prompt makes progress. Before it has
measured a large step, and with no target, nothing is limited.
"""

MIN_TOKENS_MEASURED = 32  # steps with fewer tokens (decodes alone) measure the fixed part of a step
SMOOTHING = 0.3  # the weight of the newest step in the average


class StepPacer:
    def __init__(self, target_ms: float | None, min_tokens: int, max_tokens: int):
        self.target_s = target_ms / 1000 if target_ms else None
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.fixed_s: float | None = None  # what a step costs whatever its tokens
        self.seconds_per_token: float | None = None  # and what each token adds

    def prompt_tokens_when_shared(self) -> int | None:
        """The limit for the next step (None: none)."""
        if self.target_s is None or self.seconds_per_token is None:
            return None
        fit = int((self.target_s - (self.fixed_s or 0.0)) / self.seconds_per_token)
        return max(self.min_tokens, min(fit, self.max_tokens))

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` took `seconds` (its forward pass and sampling)."""
        if seconds <= 0:
            return
        if num_tokens < MIN_TOKENS_MEASURED:
            self.fixed_s = _average(self.fixed_s, seconds)
            return
        # what the tokens took beyond the fixed part (never less than a tenth of the step: a noisy fixed part)
        rate = max(seconds - (self.fixed_s or 0.0), seconds / 10) / num_tokens
        self.seconds_per_token = _average(self.seconds_per_token, rate)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
