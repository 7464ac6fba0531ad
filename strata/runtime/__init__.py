"""Running a model: sampling and the generation loop."""
from .generate import GenerationResult, generate
from .sampling import SamplingParams, Sampler

__all__ = ["GenerationResult", "generate", "SamplingParams", "Sampler"]
