"""OpenMetrics 1.0 text (the agent's ``GET /metrics``), put together from
its own figures and the expositions of the node's probes; and the same
figures in Prometheus' text format 0.0.4 (``text_format``) for a scraper
that does not ask for OpenMetrics (``wants_openmetrics``): ``curl``,
``promtool check metrics``."""

from __future__ import annotations

import re
from collections.abc import Mapping

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?\s+(.*)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Mapping[str, str]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{{{inner}}}" if inner else ""


class Exposition:
    """OpenMetrics 1.0 text, built family by family: each family's ``TYPE``
    and ``HELP`` once, its samples together, each counter's ``_total``
    followed by its ``_created``; ``# EOF`` last."""

    def __init__(self) -> None:
        self._heads: dict[str, dict[str, str]] = {}  # family -> {"TYPE": line, "HELP": line}
        self._samples: dict[str, list[str]] = {}

    def _family(self, name: str) -> list[str]:
        self._heads.setdefault(name, {})
        return self._samples.setdefault(name, [])

    def _head(self, name: str, what: str, line: str) -> None:
        self._family(name)
        self._heads[name].setdefault(what, line)  # the first one said wins

    def gauge(self, name: str, doc: str, samples: list[tuple[dict[str, str], float]]) -> None:
        self._head(name, "TYPE", f"# TYPE {name} gauge")
        self._head(name, "HELP", f"# HELP {name} {doc}")
        self._family(name).extend(f"{name}{_labels(k)} {v}" for k, v in samples)

    def counter(
        self, name: str, doc: str, samples: list[tuple[dict[str, str], float]], created: float
    ) -> None:
        self._head(name, "TYPE", f"# TYPE {name} counter")
        self._head(name, "HELP", f"# HELP {name} {doc}")
        for k, v in samples:
            self._family(name).extend(
                [f"{name}_total{_labels(k)} {v}", f"{name}_created{_labels(k)} {created:.3f}"]
            )

    def merge(self, text: str, labels: Mapping[str, str], created: float) -> None:
        """``text``'s families and samples (another exposition's), each sample
        with those of ``labels`` it does not name itself; a counter's
        ``_total`` with its ``_created`` (``created``) where ``text`` has none."""
        family, kind = "", ""
        kinds: dict[str, str] = {}
        for line in text.splitlines():
            if line.startswith(("# TYPE ", "# HELP ")):
                parts = line.split(maxsplit=3)
                if len(parts) < 3:
                    continue
                family = parts[2]
                if parts[1] == "TYPE":
                    kinds[family] = parts[3].strip() if len(parts) > 3 else "unknown"
                kind = kinds.get(family, "")
                self._head(family, parts[1], line)
                continue
            m = _SAMPLE.match(line)
            if m is None or line.startswith("#"):
                continue
            name, inner, rest = m.group(1), m.group(2) or "", m.group(3)
            named = set(_LABEL.findall(inner))
            extra = {k: v for k, v in labels.items() if k not in named}
            both = ",".join(x for x in (inner, _labels(extra)[1:-1]) if x)
            samples = self._family(family or name)
            samples.append(f"{name}{{{both}}} {rest}")
            if kind == "counter" and name == f"{family}_total" and f"{family}_created" not in text:
                samples.append(f"{family}_created{{{both}}} {created:.3f}")

    def text(self) -> str:
        out = []
        for name, samples in self._samples.items():
            heads = self._heads.get(name, {})
            out += [heads[h] for h in ("TYPE", "HELP") if h in heads] + samples
        return "\n".join([*out, "# EOF"]) + "\n"


def wants_openmetrics(accept: str | None) -> bool:
    """Whether a scraper's ``Accept`` header takes OpenMetrics: Prometheus
    names it first; a request that names no format (the agent asking a
    probe) gets it too. ``curl`` (``*/*``) gets the text format."""
    if not accept:
        return True
    return any(
        part.split(";")[0].strip().lower() == "application/openmetrics-text"
        for part in accept.split(",")
    )


def text_format(openmetrics: str) -> str:
    """OpenMetrics text (ours) in Prometheus' text format 0.0.4, as
    ``promtool check metrics`` and Prometheus' own clients write it: a
    counter ``f`` is the family ``f_total`` (its ``HELP`` and ``TYPE``
    counter) and its ``_created`` the gauge ``f_created``; ``unknown`` is
    ``untyped``; no ``# EOF`` (our families: counters and gauges, no info
    or stateset)."""
    kinds: dict[str, str] = {}
    helps: dict[str, str] = {}
    groups: dict[str, list[str]] = {}  # output family -> its samples, in order
    for line in openmetrics.splitlines():
        if line.startswith(("# TYPE ", "# HELP ")):
            parts = line.split(" ", 3)
            if len(parts) == 4:
                (kinds if parts[1] == "TYPE" else helps)[parts[2]] = parts[3].strip()
            continue
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        groups.setdefault(_family_of(m.group(1), kinds), []).append(line)
    out = []
    for name, samples in groups.items():
        kind, doc = _head_of(name, kinds, helps)
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(out) + "\n" if out else ""


def _family_of(sample: str, kinds: Mapping[str, str]) -> str:
    """The text format's family of a sample: a counter's ``_total`` and
    ``_created`` each a family of their own, any other sample its name's."""
    for suffix in ("_total", "_created"):
        base = sample.removesuffix(suffix)
        if base != sample and kinds.get(base) == "counter":
            return sample
    return sample if sample in kinds else _base(sample, kinds)


def _base(sample: str, kinds: Mapping[str, str]) -> str:
    """A histogram's or summary's family (``_bucket``, ``_sum``, ``_count``)."""
    for suffix in ("_bucket", "_sum", "_count"):
        base = sample.removesuffix(suffix)
        if base != sample and kinds.get(base) in ("histogram", "summary"):
            return base
    return sample


def _head_of(name: str, kinds: Mapping[str, str], helps: Mapping[str, str]) -> tuple[str, str]:
    """(text-format type, HELP text) of a text-format family."""
    family, kind = name, kinds.get(name, "unknown")
    for suffix, as_kind in (("_total", "counter"), ("_created", "gauge")):
        base = name.removesuffix(suffix)
        if base != name and kinds.get(base) == "counter":
            family, kind = base, as_kind
    doc = helps.get(family, family.replace("_", " "))
    if family != name and kind == "gauge":
        doc = f"when {family} started counting (unix seconds): {doc}"
    # OpenMetrics escapes a HELP's double quotes; the text format has no such escape
    doc = doc.replace('\\"', '"')
    return ("untyped" if kind == "unknown" else kind), doc
