"""The one error of the HF <-> Megatron bridge: a model it cannot represent exactly.

Raised by common/model/bridge.py and the family modules beside it (bridge_moe.py, bridge_mla.py),
which bridge.py imports: a module of its own keeps those imports pointing one way.
"""


class UnsupportedModelError(ValueError):
    """The HF model cannot be represented exactly by the megatron GPTModel we build."""
