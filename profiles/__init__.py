"""Hardware and model profiles: TOML data files plus a small validating loader.

    >>> from tierwise.profiles import load_model_profile, load_hardware_profile
    >>> load_model_profile("7b").num_params
    6738415616
"""

from .hardware import CxlSpec, GpuSpec, HardwareProfile, HostSpec, NodeSpec, NvmeSpec, PcieSpec
from .model import ModelProfile
from .registry import known_profiles, load_hardware_profile, load_model_profile
from .schema import (FieldTypeError, FieldValueError, MissingFieldError, ProfileError,
                     ProfileFieldError, UnknownFieldError, UnknownProfileError)

__all__ = [
    "CxlSpec", "GpuSpec", "HardwareProfile", "HostSpec", "NodeSpec", "NvmeSpec", "PcieSpec", "ModelProfile",
    "known_profiles", "load_hardware_profile", "load_model_profile", "FieldTypeError", "FieldValueError",
    "MissingFieldError", "ProfileError", "ProfileFieldError", "UnknownFieldError", "UnknownProfileError",
]
