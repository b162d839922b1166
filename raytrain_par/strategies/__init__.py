"""Strategies by name: each name is a preset of the parallel layout (layout.py) and the engine that
trains it. Adding one: a module with an `Engine` subclass whose `Options` dataclass lists its
`strategy:` keys and says its layout, one line here, and its tests."""

from __future__ import annotations

import importlib

from .base import Engine
from .context import DistContext
from .layout import Layout

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


def engine_class(name: str, options=None) -> type[Engine]:
    """The engine of strategy `name`; given its options, the one they choose where a strategy's options
    pick among engines (`Options.engine`: megatron with stages runs on the pipeline engine's schedules).
    Without options, the registry's (whose `Options` parses the `strategy:` keys)."""
    path = getattr(options, "engine", None) or REGISTRY[name]
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def layout_of(strategy, workers: int) -> Layout:
    """The layout a strategy (the experiment's StrategySpec: name + options) stands for on `workers`."""
    return engine_class(strategy.name, strategy.options).layout_for(strategy.options, workers)


def build_engine(strategy, model, task, train, ctx: DistContext, total_steps: int) -> Engine:
    """`strategy`: the experiment's StrategySpec (name + options). `model`: whole, or built with its parameters
    on the meta device (models.build's `on_meta`): the engine then gives storage only to what this rank
    holds, to be filled (`start_from_initial`, or a checkpoint's `load`)."""
    return engine_class(strategy.name, strategy.options)(model, task, train, strategy.options, ctx, total_steps)


def start_engine(spec, info, ctx: DistContext, total_steps: int, fill: bool = True):
    """(engine, task) of experiment `spec` on this rank: the model built on the meta device, then only what
    this rank holds given storage; with `fill`, filled with the weights the run starts from (a run that
    resumes fills it from its checkpoint instead)."""
    from .. import models

    model, task = models.build(spec.model, info, spec.train.seed, on_meta=True)
    engine = build_engine(spec.strategy, model, task, spec.train, ctx, total_steps)
    if fill:
        start_from_initial(engine, spec, info)
    return engine, task


def start_from_initial(engine: Engine, spec, info) -> None:
    """What `engine` holds filled with the weights run `spec` starts from (strategies/initial.py), as it would
    be from a checkpoint (`Engine.load_pieces`): every rank at once, each reading its own pieces."""
    from .initial import initial_weights

    initial = initial_weights(spec.model, info, spec.train.seed)
    engine.load_pieces(initial)
    initial.done()


__all__ = ["DistContext", "Engine", "Layout", "NAMES", "REGISTRY", "engine_class", "layout_of", "build_engine",
           "start_engine", "start_from_initial"]
