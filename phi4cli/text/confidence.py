"""A trace's confidence from the model's own token probabilities (DeepConf, arXiv 2508.15260).

A token's confidence is the negative mean log-probability of the ``TOP_K`` likeliest tokens at
its step: high where the model was sure (the likeliest takes nearly all the probability, the
others are very unlikely), low where it hesitated among several. A trace's *mean* confidence is
over all its tokens; its *lowest group* confidence is the lowest mean over a sliding window of
``GROUP`` tokens (the whole trace, when it is shorter): the stretch where the reasoning was
least sure, which DeepConf found tells wrong traces from right ones better than the mean.

The daemon computes a token's from the logits (``LogitsConfidence``, one pass over the
vocabulary); a remote engine from a server's ``top_logprobs`` (``from_logprobs``).

A token's confidence is at most ``MAX_CONFIDENCE`` (a log-probability below ``-MAX_CONFIDENCE``
counts as that): a server may send any finite number (a stand-in for "impossible" such as -9999,
or -1e308), and sums of unbounded ones overflow to infinity, then NaN. The bound is far above
the spread of a model's logits, so it changes no real trace's numbers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

TOP_K = 20  # as DeepConf, and the most OpenAI's top_logprobs allows
GROUP = 2048  # tokens of a group (DeepConf's window)
# DeepConf online (``--stop-unsure``): the first WARMUP traces of a question run to their end;
# the floor is then the confidence below which the least sure (1 - KEEP) of them lie, and a later
# trace whose window's confidence falls below it is stopped. KEEP = 0.9 is DeepConf-high, the
# milder of the paper's two; its other, keeping the surest 10%, needs many more warm-up traces
# than a --samples of 8 or 16 has.
WARMUP = 3
KEEP = 0.9
# The most a token's confidence can be: its step's likeliest tokens all at -MAX_CONFIDENCE (a
# probability of e^-10000, impossible by any measure). Sums of a trace's tokens stay finite.
MAX_CONFIDENCE = 1e4


def bounded(confidence: float) -> float:
    """A token's confidence within [0, MAX_CONFIDENCE] (a log-probability is never above 0);
    NaN stays NaN."""
    if math.isnan(confidence):
        return confidence
    return min(max(confidence, 0.0), MAX_CONFIDENCE)


def floor_from(confidences: Sequence[float], keep: float = KEEP) -> float | None:
    """The confidence below which a trace is stopped: the (1 - ``keep``) quantile of the
    warm-up traces' lowest group confidences (linear between the two nearest, as numpy's
    default); None without any."""
    values = sorted(c for c in confidences if math.isfinite(c))
    if not values:
        return None
    at = (1.0 - keep) * (len(values) - 1)
    low = math.floor(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def from_logprobs(logprobs: Sequence[float]) -> float | None:
    """A token's confidence from the log-probabilities of its step's likeliest tokens: finite,
    in [0, MAX_CONFIDENCE], for any finite ones (each taken within [-MAX_CONFIDENCE, 0]); None
    without any."""
    if not logprobs:
        return None
    return math.fsum(bounded(-value) for value in logprobs) / len(logprobs)


class LogitsConfidence:
    """A token's confidence from its step's logits: log-softmax of the ``TOP_K`` likeliest,
    with two buffers of the vocabulary's size kept between calls (no allocation per token)."""

    def __init__(self, n_vocab: int, top_k: int = TOP_K) -> None:
        import numpy as np

        self.n_vocab, self.top_k = n_vocab, min(top_k, n_vocab)
        self._top = np.empty(n_vocab, dtype=np.float32)
        self._exp = np.empty(n_vocab, dtype=np.float32)

    def __call__(self, logits: np.ndarray) -> float:
        import numpy as np

        top, exp, cut = self._top, self._exp, self.n_vocab - self.top_k
        np.copyto(top, logits)
        top.partition(cut)
        best = float(top[cut:].max())
        np.subtract(logits, best, out=exp)
        np.exp(exp, out=exp)
        normaliser = best + float(np.log(exp.sum(dtype=np.float64)))
        return normaliser - float(top[cut:].mean(dtype=np.float64))


# A log-probability is never reported below this: OpenAI's own stand-in for "impossible", and
# what JSON can carry (-inf cannot be written).
LOWEST_LOGPROB = -9999.0


class TokenLogprobs:
    """What OpenAI's ``logprobs`` reports of a sampled token: its log-probability under the
    model's distribution at that step (the log-softmax of the raw logits, before temperature
    and the samplers, as llama-server reports) and the ``top`` likeliest tokens' — the same
    numbers :class:`LogitsConfidence` averages. One buffer of the vocabulary's size is kept."""

    def __init__(self, n_vocab: int) -> None:
        import numpy as np

        self._work = np.empty(n_vocab, dtype=np.float32)

    def __call__(
        self, logits: np.ndarray, token: int, top: int
    ) -> tuple[float, list[tuple[int, float]]]:
        import numpy as np

        best = float(logits.max())
        np.subtract(logits, best, out=self._work)
        np.exp(self._work, out=self._work)
        normaliser = best + float(np.log(self._work.sum(dtype=np.float64)))

        def logprob(index: int) -> float:
            value = float(logits[index]) - normaliser
            return max(value, LOWEST_LOGPROB) if math.isfinite(value) else LOWEST_LOGPROB

        likeliest: list[tuple[int, float]] = []
        if top > 0:
            top = min(top, len(logits))
            ids = np.argpartition(logits, len(logits) - top)[len(logits) - top :]
            ordered = sorted((int(i) for i in ids), key=lambda i: -float(logits[i]))
            likeliest = [(index, logprob(index)) for index in ordered]
        return logprob(token), likeliest


class TraceConfidence:
    """A trace's token confidences as they come: their mean and the lowest group mean."""

    def __init__(self, group: int = GROUP) -> None:
        self.group = group
        self.tokens = 0
        self._sum = 0.0
        self._window: deque[float] = deque(maxlen=group)
        self._window_sum = 0.0
        self._lowest: float | None = None

    def add(self, confidence: float) -> None:
        """Take a token's confidence, bounded (:func:`bounded`: the sums stay finite); one that
        is not finite (a step whose logits are mostly -inf, or NaN) is passed over."""
        if not math.isfinite(confidence):
            return
        confidence = bounded(confidence)
        self.tokens += 1
        self._sum += confidence
        if len(self._window) == self.group:
            self._window_sum -= self._window[0]
        self._window.append(confidence)
        self._window_sum += confidence
        if len(self._window) == self.group:
            mean = self._window_sum / self.group
            self._lowest = mean if self._lowest is None else min(self._lowest, mean)

    @property
    def window(self) -> float | None:
        """The mean of the last GROUP tokens; None until there are GROUP of them."""
        return self._window_sum / self.group if len(self._window) == self.group else None

    def below(self, floor: float | None) -> bool:
        """Whether the last GROUP tokens' confidence is under ``floor`` (DeepConf online's
        test; never before GROUP tokens, nor without a floor)."""
        window = self.window
        return floor is not None and window is not None and window < floor

    @property
    def mean(self) -> float | None:
        return self._sum / self.tokens if self.tokens else None

    @property
    def lowest_group(self) -> float | None:
        """The lowest mean over GROUP tokens in a row; the mean, for a shorter trace."""
        return self._lowest if self._lowest is not None else self.mean

    def stats(self) -> dict[str, float | int | None]:
        """What Stats carries: rounded, and None for a trace without any."""

        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        return {
            "confidence": rounded(self.mean),
            "lowest_group_confidence": rounded(self.lowest_group),
            "confidence_tokens": self.tokens,
        }
