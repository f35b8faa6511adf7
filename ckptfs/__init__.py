"""ckptfs: a FUSE checkpoint filesystem for ML training.

Mounted as the checkpoint directory, it takes `torch.save` and PyTorch DCP writes into a local
write-back cache (`cachemgr`) at local-disk speed and tiers committed shard sets to an object
store. This package holds the FUSE layer (`fuse`), the CLI (`cli`), the mount lifecycle (`mount`)
and the Python API re-exported here: `wait_durable`, `wait_replicated`, `commit`, `prefetch`,
`status`.
"""

# The one version: pyproject.toml reads it (setuptools dynamic version, attr), `ckptfs --version`
# prints it (tests/unit/test_fstab.py checks both agree with the installed distribution).
__version__ = "0.2.0"

from .api import (
    CkptfsError,
    NotDurable,
    commit,
    prefetch,
    status,
    wait_durable,
    wait_replicated,
)

__all__ = ["CkptfsError", "NotDurable", "__version__", "commit", "prefetch", "status",
           "wait_durable", "wait_replicated"]
