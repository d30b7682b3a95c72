"""OpenMetrics 1.0 text (the agent's ``GET /metrics``), put together from
its own figures and the expositions of the node's probes."""

from __future__ import annotations

import re
from collections.abc import Mapping

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
