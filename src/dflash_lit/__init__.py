"""dflash-lit: train DFlash block-diffusion speculative-decoding drafters."""

from dflash_lit.model.config import DFlashConfig, default_target_layer_ids
from dflash_lit.model.drafter import DFlashDrafter

__all__ = ["DFlashConfig", "DFlashDrafter", "default_target_layer_ids"]
__version__ = "0.1.0"
