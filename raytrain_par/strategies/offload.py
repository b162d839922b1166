"""Checks before start for strategies that offload model states to host memory."""

from __future__ import annotations


def check_host_memory(spec, engine_cls, options, field_: str, error) -> None:
    """Offloading strategies: the states they move to host memory must fit there. Counts the
    model's parameters on the meta device (no memory, any size)."""
    from .. import data, models
    from ..metrics.memory import available_host_memory, size_text

    model, _ = models.build_on_meta(spec.model, data.shape_of(spec.data))
    n = models.parameter_count(model)
    est = engine_cls.model_state_bytes(options, spec.train, spec.layout.data, n)
    if options.host_memory_gb is not None:
        per_worker, where = options.host_memory_gb * 2**30, f"strategy.host_memory_gb = {options.host_memory_gb:g}"
    else:
        free = available_host_memory()
        per_worker = free / spec.scaling.num_workers
        where = f"{size_text(free)} available on this machine for {spec.scaling.num_workers} worker(s)"
    if est.offloaded > per_worker:
        error(field_, True, f"the offloaded states of {n / 1e6:.1f}M parameters need {size_text(est.offloaded)} "
              f"of host memory per worker, more than the {size_text(per_worker)} there is ({where})",
              "use more workers (the offloaded states are divided among them), a machine with more memory, "
              "or turn offloading off; set strategy.host_memory_gb if workers run on other machines")

