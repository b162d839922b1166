"""Strategies by name. Adding one: a module with an `Engine` subclass whose `Options` dataclass lists
its `strategy:` keys, one line here, and its tests."""

from __future__ import annotations

import importlib

from .base import DistContext, Engine

REGISTRY: dict[str, str] = {
    "ddp": "raytrain_par.strategies.ddp:DDPEngine",
    "megatron": "raytrain_par.strategies.megatron:MegatronEngine",
    "zero-1": "raytrain_par.strategies.zero:Zero1Engine",
    "zero-2": "raytrain_par.strategies.zero:Zero2Engine",
    "zero-3": "raytrain_par.strategies.zero:Zero3Engine",
    "fsdp": "raytrain_par.strategies.fsdp:FSDPEngine",
    "pipeline": "raytrain_par.strategies.pipeline:PipelineEngine",
    "pipedream": "raytrain_par.strategies.pipedream:PipeDreamEngine",
}
NAMES = tuple(REGISTRY)


def engine_class(name: str) -> type[Engine]:
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_engine(strategy, model, task, train, ctx: DistContext, total_steps: int) -> Engine:
    """`strategy`: the experiment's StrategySpec (name + options)."""
    return engine_class(strategy.name)(model, task, train, strategy.options, ctx, total_steps)


__all__ = ["DistContext", "Engine", "NAMES", "REGISTRY", "engine_class", "build_engine"]
