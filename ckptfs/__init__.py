"""ckptfs: a FUSE checkpoint filesystem for ML training.

Mounted as the checkpoint directory, it takes `torch.save` and PyTorch DCP writes into a local
write-back cache (`cachemgr`) at local-disk speed and tiers committed shard sets to an object
store. This package holds the FUSE layer (`fuse`), the CLI (`cli`), the mount lifecycle (`mount`)
and the Python API re-exported here: `wait_durable`, `commit`, `status`.
"""

__version__ = "0.2.0"

from .api import CkptfsError, NotDurable, commit, prefetch, status, wait_durable  # noqa: E402

__all__ = ["CkptfsError", "NotDurable", "commit", "prefetch", "status", "wait_durable",
           "__version__"]
