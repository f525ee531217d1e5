"""The one decode protocol: every loop that feeds a model its own tokens runs one step ahead through the
streaming store's miss check.

The forward of step n+1 is queued on the device before step n's token is read back, as mlx-lm's
``generate_step`` does, so the host builds the next graph while the device computes. On a streaming model (one
with a ``streaming_store``) each queued forward leaves its check of the routed experts queued too
(``MissGuard.queueing``); the check of step n is confirmed once step n+1 is queued. On a miss the forward queued
behind it is dropped, the caches go back to before step n (``MissGuard.confirm``), the loop's own state goes back
too (``rewind``: a sampler's random key, the logits processors' token history) and step n runs again, its
experts loaded. A model without a store runs the same loop with nothing to confirm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import mlx.core as mx

#: ``step(token)`` builds the forward after ``token`` (lazy) and returns ``(next token, *what else it gives)``.
Step = Callable[[mx.array], tuple]
#: ``rewind()``, called before each step is built, returns what puts the loop's own state back to that point.
Rewind = Callable[[], Callable[[], None]]


def _nothing_to_rewind() -> Callable[[], None]:
    return lambda: None


@dataclass
class _Queued:
    """A step queued on the device: its result (lazy), its forward's check (None: nothing to confirm), what
    rewinds the loop's state to before it was built, and the token it was fed."""

    result: tuple
    check: Optional[object]
    undo: Callable[[], None]
    token: mx.array


def run_ahead(model, step: Step, first: tuple, max_tokens: int, rewind: Rewind = _nothing_to_rewind,
              feed_last: bool = False) -> Iterator[tuple]:
    """Yield ``first`` (the step the prefill gave, checked already) and the results of the steps after it,
    ``max_tokens`` in all (-1: no end), each once its forward's check is confirmed.

    ``feed_last``: the caches outlive the loop (mlx-lm's prompt cache), so, as mlx-lm's loop does, the step after
    the last token is queued too, and when the loop ends (exhausted or closed) its check is confirmed and a miss
    run again: the caches then hold what mlx-lm's own loop leaves. Without it a loop stopped one step ahead
    drops the step it queued, unchecked."""
    guard = guard_of(model)
    current, unconfirmed, pending = first, None, None
    n = 0
    try:
        while n != max_tokens:
            if feed_last or n + 1 != max_tokens:
                pending = queue_step(guard, step, current[0], rewind)
            if unconfirmed is not None and not confirm_step(guard, unconfirmed):
                current = step(unconfirmed.token)
                if pending is not None:
                    pending = queue_step(guard, step, current[0], rewind)
            yield current
            n += 1
            unconfirmed, pending = pending, None
            if unconfirmed is not None:
                current = unconfirmed.result
    finally:
        outstanding = pending or unconfirmed  # closed at a yield, or ended with the step after the last token
        if guard is not None and feed_last and outstanding is not None and not confirm_step(guard, outstanding):
            mx.eval(*_arrays(step(outstanding.token)))
        if guard is not None:
            guard.drop_queued()


def guard_of(model):
    """The miss check of a streaming model (``MissGuard``); None for any other model."""
    return getattr(getattr(model, "streaming_store", None), "guard", None)


def _arrays(result: tuple) -> list:
    return [r for r in result if isinstance(r, mx.array)]


def queue_step(guard, step: Step, token: mx.array, rewind: Rewind = _nothing_to_rewind) -> _Queued:
    """The step after ``token``, queued on the device with its forward's check (``guard``: ``guard_of`` the
    model)."""
    undo = rewind()
    if guard is None:
        result, checks = step(token), ()
    else:
        with guard.queueing() as checks:
            result = step(token)
    # the check's routes too: confirming it then waits for nothing the device has not already been given
    mx.async_eval(*_arrays(result), *(c.flat for c in checks))
    return _Queued(result, checks[0] if checks else None, undo, token)


def confirm_step(guard, queued: _Queued) -> bool:
    """Whether ``queued``'s forward found its experts resident; if not, its caches and the loop's state are back
    to before it (the step behind it dropped), for the caller to run it again."""
    if queued.check is None or guard.confirm(queued.check):
        return True
    queued.undo()
    return False
