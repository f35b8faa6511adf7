#!/usr/bin/env bash
# Regenerates ckptfs/csi/csi_pb2.py, csi_pb2.pyi and csi_pb2_grpc.py from ckptfs/csi/csi.proto,
# the CSI spec's own file (github.com/container-storage-interface/spec, csi.proto at tag
# v1.12.0, commit e6fc13ea4d529db12e211ef79c924ee3186c39d5), with grpcio-tools (pip install
# grpcio-tools; not a dependency: the generated files are checked in). Run from anywhere.
# To move to another spec version: replace csi.proto with that tag's file and rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# -I . : the generated grpc module imports `from ckptfs.csi import csi_pb2`, a package import
"$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
    ckptfs/csi/csi.proto
echo "regenerated ckptfs/csi/csi_pb2.py, csi_pb2.pyi, csi_pb2_grpc.py"
