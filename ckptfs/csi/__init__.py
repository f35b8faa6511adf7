"""The Kubernetes CSI node plugin, `ckptfs csi` (docs/KUBERNETES.md).

kubelet talks to it over gRPC on a unix socket (the CSI spec's Identity and Node services,
`csi.proto` v1.12.0 and the stubs generated from it by scripts/gen_csi.sh: `csi_pb2*.py`). A
NodePublishVolume runs `ckptfs mount` at the pod's target path, a NodeUnpublishVolume runs
`ckptfs umount --timeout S` there: the plugin holds no mount state of its own, the kernel's mount
table and the daemons' registrations are the truth it reads.

Modules: `volume` turns a request into a mount plan (argv, environment, cache dir) and refuses
what it cannot serve; `node` runs the services; `server` binds the socket and serves until
SIGTERM; `cli` is the `ckptfs csi` subcommand. This file imports nothing heavy: `ckptfs.cli`
registers the subcommand without grpc installed (the `csi` extra).
"""

# The driver's name: GetPluginInfo, the CSIDriver object, the DaemonSet's socket directory
# (/var/lib/kubelet/plugins/<name>/) and every PersistentVolume's `csi.driver` must agree
# (tests/multinode/test_csi.py checks deploy/kubernetes/ against it).
DRIVER_NAME = "ckptfs.csi.ckptfs.io"
