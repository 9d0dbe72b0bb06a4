"""Layer-split coordinator over fleetd endpoints: synthetic workload, hub or direct boundaries."""

from fleetd.pipeline.coordinator import Pipeline, p2p_from_env
from fleetd.pipeline.report import per_step, step_table
from fleetd.pipeline.results import StepResult
from fleetd.pipeline.synthetic import Workload

__all__ = ["Pipeline", "StepResult", "Workload", "p2p_from_env", "per_step", "step_table"]
