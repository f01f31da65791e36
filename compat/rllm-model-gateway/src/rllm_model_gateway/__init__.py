"""rllm-model-gateway: lightweight LLM call proxy for RL agent training."""

from rllm_model_gateway._version import __version__
from rllm_model_gateway.client import AsyncGatewayClient, GatewayClient
from rllm_model_gateway.models import (
    GatewayConfig,
    SessionInfo,
    TraceRecord,
    WorkerConfig,
    WorkerInfo,
)
from rllm_model_gateway.server import create_app

__all__ = [
    "__version__",
    "create_app",
    "GatewayClient",
    "AsyncGatewayClient",
    "GatewayConfig",
    "TraceRecord",
    "WorkerConfig",
    "WorkerInfo",
    "SessionInfo",
]
