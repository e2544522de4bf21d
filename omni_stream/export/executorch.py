"""ExecuTorch target: an ExportedProgram lowered to a ``.pte`` with the XNNPACK delegate.

``torch_program.export_program(fmt="pte")`` traces the streaming Code2Wav once (the same
ExportedProgram the pt2 and AOTInductor formats start from) and hands it here;
``runtime_torch.load_program`` runs the result through ``executorch.runtime``. ExecuTorch is an
optional dependency (``pip install executorch==1.4.1``, the ``edge`` extra), imported only here
and only when a ``.pte`` is asked for.
"""

from __future__ import annotations

import logging

from omni_stream.export.manifest import ExportError

__all__ = ["lower_to_pte", "require_executorch"]


def require_executorch() -> None:
    """Fail before any work when ExecuTorch is missing, naming the install command."""
    try:
        import executorch  # noqa: F401
    except ImportError as e:
        raise ExportError(f"--format pte needs ExecuTorch ({e}): `pip install executorch==1.4.1` "
                          "(it works with torch 2.13.0)") from e


def lower_to_pte(ep) -> bytes:
    """ExecuTorch program (bytes) of ``ep`` with every op XNNPACK supports delegated to it."""
    logging.getLogger("torchao").setLevel(logging.ERROR)  # "no triton" noise on CPU-only hosts
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.generic_node_configs import EluConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    # ELU is left out of XNNPACK's default configs in executorch 1.4; Code2Wav has none today,
    # but a codec variant with ELU activations would otherwise run them unaccelerated.
    configs = list(ALL_PARTITIONER_CONFIGS) + [EluConfig]
    edge = to_edge_transform_and_lower(
        ep, partitioner=[XnnpackPartitioner(configs=configs)],
        compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.to_executorch().buffer
