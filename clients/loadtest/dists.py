"""Integer distributions for prefill lengths, decode steps and speculative tokens, parsed from short specs.

    const:32            always 32
    uniform:64:512      an integer in [64, 512], uniformly
    normal:256:64       normal with mean 256 and deviation 64, rounded, at least 1
    lognormal:256:0.5   lognormal with median 256 and sigma 0.5 (of the log), rounded, at least 1
    exp:100             exponential with mean 100, rounded, at least 1
    choice:1,16,256     one of the listed values, uniformly

``normal``, ``lognormal`` and ``exp`` take optional bounds after the parameters: ``normal:256:64:16:1024``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional


class DistError(ValueError):
    pass


@dataclass(frozen=True)
class Dist:
    kind: str
    params: tuple
    lo: int = 1
    hi: Optional[int] = None
    spec: str = ""

    def sample(self, rng: random.Random) -> int:
        k, p = self.kind, self.params
        if k == "const":
            v = p[0]
        elif k == "uniform":
            v = rng.randint(p[0], p[1])
        elif k == "choice":
            v = rng.choice(p)
        elif k == "normal":
            v = rng.gauss(p[0], p[1])
        elif k == "lognormal":
            v = math.exp(rng.gauss(math.log(p[0]), p[1]))
        elif k == "exp":
            v = rng.expovariate(1.0 / p[0])
        else:  # pragma: no cover - parse() admits only the kinds above
            raise DistError(self.kind)
        v = int(round(v))
        v = max(self.lo, v)
        if self.hi is not None:
            v = min(self.hi, v)
        return v

    @property
    def mean(self) -> float:
        """The mean before rounding and clipping (good enough to size an open-loop arrival rate)."""
        k, p = self.kind, self.params
        if k == "const":
            return float(p[0])
        if k == "uniform":
            return (p[0] + p[1]) / 2
        if k == "choice":
            return sum(p) / len(p)
        if k == "normal":
            return float(p[0])
        if k == "lognormal":
            return p[0] * math.exp(p[1] ** 2 / 2)
        return float(p[0])

    @property
    def max(self) -> int:
        """An upper bound of the samples (a high percentile for unbounded kinds)."""
        k, p = self.kind, self.params
        if self.hi is not None:
            return self.hi
        if k == "const":
            return int(p[0])
        if k == "uniform":
            return int(p[1])
        if k == "choice":
            return int(max(p))
        if k == "normal":
            return int(p[0] + 6 * p[1]) + 1
        if k == "lognormal":
            return int(p[0] * math.exp(6 * p[1])) + 1
        return int(p[0] * 20) + 1

    def __str__(self) -> str:
        return self.spec


_ARITY = {"const": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exp": 1}
USAGE = ("a distribution spec: const:N, uniform:LO:HI, normal:MEAN:SD[:LO[:HI]], lognormal:MEDIAN:SIGMA[:LO[:HI]], "
         "exp:MEAN[:LO[:HI]] or choice:A,B,C")


def parse(spec: str, *, minimum: int = 1) -> Dist:
    """Parse a spec; raise :class:`DistError` naming what is wrong. Samples are at least ``minimum``."""
    s = spec.strip()
    if s.isdigit():
        s = f"const:{s}"
    kind, _, rest = s.partition(":")
    kind = kind.lower()
    if kind == "choice":
        try:
            vals = tuple(int(v) for v in rest.split(",") if v.strip())
        except ValueError:
            raise DistError(f"{spec!r}: choice takes integers separated by commas; {USAGE}") from None
        if not vals or min(vals) < minimum:
            raise DistError(f"{spec!r}: choice needs at least one value, each >= {minimum}")
        return Dist("choice", vals, minimum, None, spec)
    if kind not in _ARITY:
        raise DistError(f"{spec!r}: unknown distribution {kind!r}; {USAGE}")
    parts = [p for p in rest.split(":")] if rest else []
    n = _ARITY[kind]
    bounded = kind in ("normal", "lognormal", "exp")
    if len(parts) < n or len(parts) > n + (2 if bounded else 0):
        raise DistError(f"{spec!r}: {kind} takes {n} parameter(s){' and optional LO:HI' if bounded else ''}; "
                        f"{USAGE}")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        raise DistError(f"{spec!r}: parameters must be numbers; {USAGE}") from None
    params = tuple(nums[:n])
    lo, hi = minimum, None
    if bounded and len(nums) > n:
        lo = max(minimum, int(nums[n]))
        if len(nums) > n + 1:
            hi = int(nums[n + 1])
    if kind in ("const", "uniform"):
        if any(v != int(v) for v in params):
            raise DistError(f"{spec!r}: {kind} takes integers")
        params = tuple(int(v) for v in params)
        if min(params) < minimum:
            raise DistError(f"{spec!r}: values must be >= {minimum}")
        if kind == "uniform" and params[0] > params[1]:
            raise DistError(f"{spec!r}: uniform needs LO <= HI")
    elif kind == "normal" and params[1] < 0:
        raise DistError(f"{spec!r}: the deviation must be >= 0")
    elif kind == "lognormal" and (params[0] <= 0 or params[1] < 0):
        raise DistError(f"{spec!r}: lognormal needs MEDIAN > 0 and SIGMA >= 0")
    elif kind == "exp" and params[0] <= 0:
        raise DistError(f"{spec!r}: exp needs MEAN > 0")
    if hi is not None and hi < lo:
        raise DistError(f"{spec!r}: HI must be >= LO")
    return Dist(kind, params, lo, hi, spec)
