"""moekit: fast FP8 Mixture-of-Experts layers on NVIDIA Hopper, with the choice of kernel measured."""

from .api import fused_moe
from .compile_ahead import warmup
from .backends import backend_names, get_backend
from .layer import MoELayer
from .routing import RoutingConfig, route
from .select import BackendUnavailableError, Choice, DeviceSpec, select_backend
from .spec import SCHEMES, MoEShape, QuantScheme, get_scheme
from .weights import MoEWeights, quantize_weights

from . import env

env.record_kernels_defined()  # the kernels above are defined: interpreted or compiled, for good

__version__ = "0.1.0"

__all__ = [
    "fused_moe",
    "MoELayer",
    "route",
    "RoutingConfig",
    "MoEShape",
    "QuantScheme",
    "SCHEMES",
    "get_scheme",
    "MoEWeights",
    "quantize_weights",
    "select_backend",
    "Choice",
    "DeviceSpec",
    "BackendUnavailableError",
    "backend_names",
    "get_backend",
    "warmup",
]
