"""Version of the ``checkpoint["dflash"]`` entry training writes and evaluation/export read.

Raise ``CKPT_VERSION`` when that entry changes incompatibly, and list the versions the readers
still understand in ``SUPPORTED_CKPT_VERSIONS``.
"""

CKPT_VERSION = 1
SUPPORTED_CKPT_VERSIONS = (CKPT_VERSION,)
