"""ckptfs: a FUSE checkpoint filesystem for ML training.

Mounted as the checkpoint directory, it takes `torch.save` and PyTorch DCP writes into a local
write-back cache (`cachemgr`) at local-disk speed. This package holds the FUSE layer (`fuse`),
the CLI (`cli`) and the mount lifecycle (`mount`).
"""

__version__ = "0.1.0"
