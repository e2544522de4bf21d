"""The orchestrator: the request lifecycle over the stage processes.

    settings.py  PipelineSettings: what one deployment runs with (torch-free)
    pipeline.py  Pipeline (one incarnation of the stage processes and rings) and the
                 Supervisor (audio reader, stage timing relay, crash recovery and restarts)
    backend.py   PipelineBackend: the server's ``contract.Backend`` (validation, admission,
                 dispatch, chunk routing, cancellation, chunk calibration)
"""

from omni_stream.orchestrator.backend import PipelineBackend
from omni_stream.orchestrator.settings import PipelineSettings

__all__ = ["PipelineBackend", "PipelineSettings"]
