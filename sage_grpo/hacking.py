"""Whether a run is hacking its reward: the trained reward rose while a held-out metric fell.

Validation scores the same prompts with the same noise every time (an ODE sampler, `--validation_seed`), so a
change between two validations is the policy's, not sampling noise. Each metric's change since the first
validation is measured in units of its spread over the validation videos (`shift`); the check warns when the
trained reward has risen by more than `reward_rise` of those units while a held-out metric has moved the wrong way
by more than `metric_drop`: once per metric per run (the caller keeps the names already warned, in `TrainState`, so
a resumed run does not warn again).

Which way is wrong is the metric's `sense`: +1 higher is better (reward components, CLIPScore, the world's
fidelity metrics: a fall is bad), -1 lower is better (a rise is bad), 0 a statistic without a better side
(brightness, saturation, contrast, motion: a move either way is drift), None reported only, never checked (the
distance from the first validation's videos, which every run that learns increases).

Pure functions of plain numbers; `post_train.validation` computes the summaries and every rank runs the same check
on the same all-reduced numbers.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = ["REWARD", "Summary", "HackingWarning", "shift", "hacking_warnings"]

REWARD = "reward_total"  # the trained reward's name among the summaries
# a spread below this share of the metric's magnitude (or 1e-6 absolute) counts as this much: one validation video,
# or videos that all score the same, would otherwise turn the smallest change into an infinite shift
MIN_RELATIVE_SPREAD = 1e-2
MIN_SPREAD = 1e-6


@dataclass(frozen=True)
class Summary:
    """One metric over the videos of one validation: mean and (population) standard deviation."""

    mean: float
    std: float

    @classmethod
    def of(cls, value) -> Summary:
        """From a Summary, a (mean, std) pair or a list [mean, std] (as train_state.json keeps it)."""
        if isinstance(value, Summary):
            return value
        mean, std = value
        return cls(float(mean), float(std))


@dataclass(frozen=True)
class HackingWarning:
    """A held-out metric that moved the wrong way while the trained reward rose (shifts in spread units)."""

    metric: str
    step: int
    metric_shift: float
    reward_shift: float
    first: float  # the metric's mean at the first validation
    now: float  # ... at this one

    def message(self) -> str:
        moved = "fell" if self.metric_shift < 0 else "rose"
        return (f"possible reward hacking at step {self.step}: the trained reward rose {self.reward_shift:+.2f} "
                f"spreads since the first validation while held-out {self.metric} {moved} {self.metric_shift:+.2f} "
                f"spreads ({self.first:.4g} -> {self.now:.4g}); look at the validation videos (warned once per "
                "metric; thresholds --hacking_reward_rise, --hacking_metric_drop)")


def shift(first, now) -> float:
    """(now.mean - first.mean) / spread, the spread being the pooled standard deviation of the two validations
    (floored: `MIN_RELATIVE_SPREAD` of the larger magnitude, at least `MIN_SPREAD`). NaN when either mean is."""
    a, b = Summary.of(first), Summary.of(now)
    if not (math.isfinite(a.mean) and math.isfinite(b.mean)):
        return math.nan
    spread = math.sqrt((a.std**2 + b.std**2) / 2) if math.isfinite(a.std) and math.isfinite(b.std) else 0.0
    floor = max(MIN_RELATIVE_SPREAD * max(abs(a.mean), abs(b.mean)), MIN_SPREAD)
    return (b.mean - a.mean) / max(spread, floor)


def _badness(s: float, sense: int) -> float:
    """How far `s` went the wrong way for a metric of `sense` (> 0: that far; <= 0: not at all)."""
    return -s if sense > 0 else s if sense < 0 else abs(s)


def hacking_warnings(first: Mapping[str, object], now: Mapping[str, object], senses: Mapping[str, int | None],
                     warned: Collection[str], *, step: int, reward_rise: float,
                     metric_drop: float) -> list[HackingWarning]:
    """The new warnings of one validation.

    first, now: {metric: Summary or (mean, std)} at the first validation and at this one, `REWARD` among them.
    senses: {held-out metric: +1 | -1 | 0 | None} (module docstring); a metric missing from `first`, `now` or
    `senses`, with a NaN mean, or in `warned` is skipped. Fires for each metric whose shift went the wrong way by
    more than `metric_drop` while the reward's shift is more than `reward_rise` (both strictly)."""
    if REWARD not in first or REWARD not in now:
        return []
    rise = shift(first[REWARD], now[REWARD])
    if not rise > reward_rise:  # NaN too
        return []
    out = []
    for name, sense in senses.items():
        if sense is None or name == REWARD or name in warned or name not in first or name not in now:
            continue
        s = shift(first[name], now[name])
        if _badness(s, sense) > metric_drop:  # NaN compares False
            out.append(HackingWarning(name, step, s, rise, Summary.of(first[name]).mean, Summary.of(now[name]).mean))
    return out
