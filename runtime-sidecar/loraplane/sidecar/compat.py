"""Compatibility checks before an adapter is loaded: against the runtime, and against its own files."""

from __future__ import annotations

from loraplane.api import AdapterTarget
from loraplane.sidecar.drivers.base import RuntimeInfo
from loraplane.sidecar.peft import PeftInfo


class Incompatible(ValueError):
    """The adapter cannot be loaded into this runtime; ``reason`` is a CamelCase word for status reports."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_target(target: AdapterTarget, runtime: RuntimeInfo) -> None:
    """What can be checked before fetching: base model digest, rank, target modules, dtype."""
    if runtime.base_model_digest is not None and target.base_model_digest != runtime.base_model_digest:
        raise Incompatible(
            "BaseModelMismatch",
            f"adapter is for base model {target.base_model_digest}, the runtime serves {runtime.base_model_digest}",
        )
    if runtime.max_lora_rank is not None and target.lora.rank > runtime.max_lora_rank:
        raise Incompatible(
            "RankTooLarge", f"rank {target.lora.rank} > the runtime's max_lora_rank {runtime.max_lora_rank}"
        )
    if runtime.target_modules is not None and (missing := set(target.lora.target_modules) - runtime.target_modules):
        raise Incompatible("UnknownTargetModules", f"the runtime has no modules {sorted(missing)}")
    if runtime.dtypes is not None and target.lora.dtype not in runtime.dtypes:
        raise Incompatible("DtypeUnsupported", f"dtype {target.lora.dtype} not in {sorted(runtime.dtypes)}")


def check_files(target: AdapterTarget, files: PeftInfo) -> None:
    """The fetched adapter must be what the AdapterRevision declares (rank, modules, dtype)."""
    spec = target.lora
    if files.rank != spec.rank or files.max_tensor_rank > spec.rank:
        raise Incompatible(
            "RankMismatch", f"the adapter's files have rank {files.rank} (tensors up to {files.max_tensor_rank}), "
            f"the revision declares {spec.rank}"
        )
    if not files.target_modules <= set(spec.target_modules):
        extra = sorted(files.target_modules - set(spec.target_modules))
        raise Incompatible("TargetModulesMismatch", f"the adapter targets undeclared modules {extra}")
    if files.dtypes != {spec.dtype}:
        raise Incompatible("DtypeMismatch", f"tensors are {sorted(files.dtypes)}, the revision declares {spec.dtype}")
