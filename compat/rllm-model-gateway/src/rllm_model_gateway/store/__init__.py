"""Pluggable trace storage backends."""

from rllm_model_gateway.store.base import TraceStore

__all__ = ["TraceStore"]
