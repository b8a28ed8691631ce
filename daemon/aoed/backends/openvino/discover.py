"""What OpenVINO offers on this machine, as the backend reads it: the light client's
discovery (aoe.ovdevices), which `aoe devices` and the daemon's device listing show too.

`find` never raises: a machine without openvino, or one whose openvino fails to load,
gets an `Offer` that says why, so `--runtime auto` goes on with onnxruntime alone and
the report says so once.
"""

from __future__ import annotations

from aoe.ovdevices import Offer, OvDevice, find, installed

__all__ = ["Offer", "OvDevice", "find", "installed"]
