"""The configurations bench_spec runs: a method and a draft budget K each, with a label for the tables."""

from __future__ import annotations

import dataclasses
import math

from jaxspec import SpecConfig
from jaxspec.methods import METHODS, names

DEFAULT = "default"  # in --ks: the method's own default setting, SpecConfig(method=...); sam's is the adaptive one
# Methods that run from a SpecConfig alone: plain decoding, the lookups, and the target's own first layers as a
# draft model (draft_model needs a second model; the trained heads have their own benchmark, bench_heads.py).
RUNNABLE = names(kind="plain") + names(kind="lookup") + ("self_draft",)


def adaptive_sam() -> SpecConfig:
    """The default (adaptive) sam setting, the one the targets are about."""
    return SpecConfig.adaptive_sam()


@dataclasses.dataclass(frozen=True)
class Config:
    method: str
    k: int | str  # an int (a fixed draft budget), or DEFAULT (the method's default setting)
    spec: SpecConfig
    core: bool  # runs at every batch and temperature; the others (the K sweep) only where --sweep-* say

    @property
    def label(self) -> str:
        if self.method == "none":
            return "none"
        if self.k == DEFAULT:
            return "sam adaptive" if self.method == "sam" else f"{self.method} default"
        return f"{self.method} K={self.k}"

    @property
    def max_k(self) -> int:
        return self.spec.num_speculative_tokens


SAM_LABEL = Config("sam", DEFAULT, adaptive_sam(), core=True).label  # the configuration the targets are about


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where configurations run: the core ones at every batch and temperature, the K sweep only at the sweep's."""

    batches: tuple[int, ...]  # the core's, then the sweep's others
    temperatures: tuple[float, ...]
    sweep_batches: tuple[int, ...]
    sweep_temperatures: tuple[float, ...]
    batch1_limit: int  # batch-1 runs take the first this many prompts of a workload

    def runs(self, config: Config, batch: int, temperature: float) -> bool:
        return config.core or (batch in self.sweep_batches and temperature in self.sweep_temperatures)


def make_configs(methods: list[str], ks: list, self_draft_ks: list, self_draft_layers: int) -> list[Config]:
    """Core: none, and the lookups at their default settings (sam's is the adaptive one: draft length tied to
    match length). Sweep: the lookups at each fixed K (draft K tokens whenever the last 2+ tokens occurred
    before; 'default' in `ks` is the core one, skipped), self_draft at each of `self_draft_ks`."""
    configs = []
    for method in methods:
        if method == "none":
            configs.append(Config("none", 0, SpecConfig(), core=True))
            continue
        if method == "self_draft":
            for k in self_draft_ks:
                spec = SpecConfig(method="self_draft", self_draft_layers=self_draft_layers,
                                  num_speculative_tokens=None if k == DEFAULT else k)
                configs.append(Config(method, k, spec, core=False))
            continue
        configs.append(Config(method, DEFAULT, adaptive_sam() if method == "sam" else SpecConfig(method=method),
                              core=True))
        for k in (k for k in ks if k != DEFAULT):
            spec = SpecConfig(method=method, num_speculative_tokens=k, min_match=2, draft_per_match=math.inf)
            configs.append(Config(method, k, spec, core=False))
    return configs


def drop_duplicates(configs: list[Config]) -> tuple[list[Config], dict[str, str]]:
    """Configurations with distinct settings (the first of equals kept), and {dropped label: kept label}."""
    kept, aliases = [], {}
    for c in configs:
        same = next((k for k in kept if k.spec == c.spec), None)
        if same is None:
            kept.append(c)
        else:
            aliases[c.label] = same.label
    return kept, aliases


def config_settings(spec: SpecConfig) -> str:
    """The settings of a configuration in words, for the report's list of configurations."""
    if spec.method == "none":
        return "plain decoding through the speculative loop"
    text = f"K={spec.num_speculative_tokens}, verify widths {spec.verify_widths}"
    if METHODS[spec.method].kind == "lookup":
        text += f", min_match={spec.min_match}, draft_per_match={spec.draft_per_match}"
    if spec.method == "ngram":
        text += f", ngram_max={spec.ngram_max}"
    if spec.method == "self_draft":
        text += f", the target's first {spec.self_draft_layers} layers"
    return text


def parse_ks(text: str) -> list:
    return [p if p == DEFAULT else int(p) for p in (p.strip() for p in text.split(",")) if p]
