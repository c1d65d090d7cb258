"""Every metrics file a test writes is read as Prometheus reads it: by ``prometheus_client``'s text
parser and, where it is installed (Debian's ``prometheus`` package; ``.ci/run`` installs it), checked by
``promtool check metrics``, which also lints the names, units and help texts."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample as ParsedSample

PROMTOOL = shutil.which("promtool")


def parsed(text: str) -> dict[str, list[ParsedSample]]:
    """The samples of an exposition text by metric name, as Prometheus reads them; promtool, when
    there, must accept it without a lint problem."""
    if PROMTOOL is not None:
        lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr
    samples: dict[str, list[ParsedSample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def read_metrics(path: Path) -> dict[str, list[ParsedSample]]:
    """A metrics file as written: a regular file of mode 0644, nothing else left in its directory."""
    info = path.lstat()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o644
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".")], "a temporary file is left"
    return parsed(path.read_text(encoding="utf-8"))


def value(samples: dict[str, list[ParsedSample]], name: str, **labels: str) -> float:
    (found,) = [s for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    return float(found.value)
