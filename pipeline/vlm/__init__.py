"""VLM stage: answer questions about a window of frames from only the visual tokens ARR-COC kept."""
from pipeline.vlm.config import VLMConfig
from pipeline.vlm.geometry import VLMGeometry
from pipeline.vlm.loading import VLMLoadError, load_vlm
from pipeline.vlm.model import VLM, AnswerRequest, AnswerResult

__all__ = ["VLMConfig", "VLMGeometry", "VLMLoadError", "load_vlm", "VLM", "AnswerRequest", "AnswerResult"]
