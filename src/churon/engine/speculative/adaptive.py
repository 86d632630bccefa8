"""AdaptiveLength: how many tokens a request proposes each step, from how many it had accepted.

Model. Each proposed position is accepted with probability a, independently, and verification stops
at the first rejection. Proposing k tokens then yields sum_{i=0..k} a^i tokens per step on average
(the target's own token plus the accepted prefix), and the step costs 1 + cost_per_token * k of the
request's share of a step (cost_per_token: what one more verification row adds to the step, as a share
of what the request's own row costs, plus a draft model's cost per token; the caller gives it each step,
since it grows with the batch). next() is the k in 0..max_tokens with the most tokens per cost, the
smallest such k on a tie. At a cost of 1 or more no k pays even if every proposal were accepted
((k + 1) / (1 + cost * k) <= 1): speculation stays off, without probes.

a is the ratio of exponentially decayed sums, accepted positions over tried positions (a verification
tries min(accepted + 1, proposed) positions: the first rejection ends it), each sum decaying by DECAY
per verification, so it follows the last few verifications. It starts at PRIOR_RATE, worth one
position, so a request speculates from its first decode step.

When the best k is 0, speculation is off for a back-off of BACKOFF_MIN steps, then one probe of k = 1
(it stays pending until a verification reports on it). A failed probe doubles the back-off, up to
BACKOFF_MAX; an accepted one resets it. A request whose proposals are never accepted (open-ended chat)
then costs about one verification row every 64 steps.
"""

from __future__ import annotations

DECAY = 0.75  # weight of the past per verification: about the last 4 verifications count
PRIOR_RATE = 0.6  # optimistic: worth speculating at any cost_per_token below about 0.6
BACKOFF_MIN = 4
BACKOFF_MAX = 64


class AdaptiveLength:
    """One request's proposal length from its recent acceptance rate."""

    def __init__(self, max_tokens: int, adaptive: bool = True):
        """max_tokens >= 1: the most tokens ever proposed (SpeculativeConfig.num_tokens); adaptive=False:
        always max_tokens."""
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self._accepted = PRIOR_RATE  # decayed sums of accepted and tried positions
        self._tried = 1.0
        self._backoff = BACKOFF_MIN
        self._off = 0  # steps left with speculation off
        self._probing = False  # speculation is off but for a probe of 1 awaiting its verification

    def next(self, cost_per_token: float) -> int:
        """Tokens to propose this step at this cost per proposed token: 0..max_tokens (always max_tokens when
        not adaptive)."""
        if not self.adaptive:
            return self.max_tokens
        if cost_per_token >= 1:
            return 0
        best = self._best_length(cost_per_token)
        if best == 0 and not self._probing:
            self._start_backoff()
        if self._off:
            self._off -= 1
            return 0
        return 1 if self._probing else best

    def update(self, proposed: int, accepted: int) -> None:
        """After a verification of proposed >= 1 tokens, accepted of them."""
        if not self.adaptive:
            return
        self._accepted = DECAY * self._accepted + accepted
        self._tried = DECAY * self._tried + min(accepted + 1, proposed)
        if self._probing:
            self._probing = False
            if accepted:
                self._backoff = BACKOFF_MIN
            else:
                self._backoff = min(2 * self._backoff, BACKOFF_MAX)
                self._start_backoff()

    def _start_backoff(self) -> None:
        self._off = self._backoff
        self._probing = True

    def _best_length(self, cost_per_token: float) -> int:
        """The k in 0..max_tokens maximizing sum_{i=0..k} a^i / (1 + cost_per_token * k)."""
        a = self._accepted / self._tried
        best, best_rate = 0, 1.0
        expected, term = 1.0, 1.0
        for k in range(1, self.max_tokens + 1):
            term *= a
            expected += term
            rate = expected / (1.0 + cost_per_token * k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best
