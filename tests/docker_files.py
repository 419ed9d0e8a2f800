"""The files under docker/, parsed, and the metric names their PromQL queries read.

Shared by the static checks (tests/unit/test_docker_files.py) and the check against a live
server's /metrics (tests/integration/test_metrics_exported.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
K8S = DOCKER / "k8s"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "triton-slo.json"
RULES = DOCKER / "prometheus" / "rules.yml"
ADAPTER = K8S / "prometheus-adapter-rules.yaml"
SCALED_OBJECT = K8S / "keda" / "scaledobject.yaml"

# Words of PromQL that look like metric names: grouping and set operators, modifiers.
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                 "unless", "inf", "nan"}


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def metric_names(expr: str) -> set[str]:
    """The metric (sample) names a PromQL expression reads: not functions, keywords, labels,
    label values, ranges, numbers, or recording rules (whose names hold a colon)."""
    expr = re.sub(r"<<[^>]*>>", "", expr)  # prometheus-adapter templates
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # grouping labels
    expr = re.sub(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", " ", expr)  # numbers, 1e-9 included
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        name = match.group(0)
        if expr[match.end():].lstrip().startswith("(") or name.lower() in _PROMQL_WORDS or ":" in name:
            continue
        names.add(name)
    return names


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]


def rule_exprs() -> list[str]:
    return [rule["expr"] for group in load_yaml(RULES)["groups"] for rule in group["rules"]]


def adapter_config() -> dict:
    return yaml.safe_load(load_yaml(ADAPTER)["data"]["config.yaml"])


def adapter_exprs() -> list[str]:
    config = adapter_config()
    return [rule[key] for rule in config.get("rules", []) + config.get("externalRules", [])
            for key in ("seriesQuery", "metricsQuery")]


def keda_exprs() -> list[str]:
    return [trigger["metadata"]["query"] for trigger in load_yaml(SCALED_OBJECT)["spec"]["triggers"]]


def queried_metric_names() -> dict[str, set[str]]:
    """Metric name -> the files whose queries read it."""
    where: dict[str, set[str]] = {}
    for source, exprs in (("dashboard", dashboard_exprs()), ("rules", rule_exprs()),
                          ("prometheus-adapter", adapter_exprs()), ("keda", keda_exprs())):
        for expr in exprs:
            for name in metric_names(expr):
                where.setdefault(name, set()).add(source)
    return where
