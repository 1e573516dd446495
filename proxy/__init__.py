"""vllm-lifeguard."""

from .compiled import keep_pure_if_asked

__version__ = "0.1.0"
# Before any module of the data plane is imported: LIFEGUARD_PURE_PYTHON=1 runs its sources, not its compiled build.
keep_pure_if_asked()
