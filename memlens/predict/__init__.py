"""``memlens predict``: run a training script on the CPU against a simulated CUDA GPU.

See ``memlens.predict.session`` for how, and the README's "Predict" section for the limits.
"""

from memlens.predict.gpus import DEFAULT_GPU, GPUS, GpuSpec
from memlens.predict.session import PredictResult, PredictSession, predict

__all__ = ["DEFAULT_GPU", "GPUS", "GpuSpec", "PredictResult", "PredictSession", "predict"]
