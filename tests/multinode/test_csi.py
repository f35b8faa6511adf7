"""The CSI node plugin (`ckptfs csi`, ckptfs/csi/) driven as kubelet drives it: gRPC calls on its
unix socket, real mounts through /dev/fuse, a real S3 endpoint (moto, or RGW or SeaweedFS with
CKPTFS_TEST_S3), checkpoints written and read by separate processes, as a pod would. And the
deployment files in deploy/ checked against the Kubernetes schemas and against the code.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml

from ckptfs.cli import mount_parser
from ckptfs.csi import DRIVER_NAME, csi_pb2, csi_pb2_grpc
from ckptfs.csi.volume import ATTRIBUTES, SECRETS, cache_dir_name
from ckptfs.mount import pid_running, registration
from tests.conftest import REPO, hold_uploads, is_mounted, new_bucket, require_fuse, wait_for

Code = grpc.StatusCode
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate bundles


def mount_capability(fs_type: str = "") -> csi_pb2.VolumeCapability:
    mode = csi_pb2.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER
    return csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs_type),
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=mode))


class Plugin:
    """One `ckptfs csi` process ("a node") and kubelet's view of it: the two stubs."""

    def __init__(self, root: Path, node_id: str, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        # sun_path holds 107 bytes: a short dir of its own, not pytest's tmp_path
        self.sock_dir = Path(tempfile.mkdtemp(prefix="csi-", dir="/tmp"))
        self.sock = self.sock_dir / "csi.sock"
        self.cache_root = root / node_id / "cache"
        self.log_path = root / f"{node_id}.log"
        self.node_id = node_id
        self.hung = ""  # the plugin's log with its threads' stacks, if a stop hung
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ckptfs", "csi", "--endpoint", f"unix://{self.sock}",
                 "--node-id", node_id, "--cache-root", str(self.cache_root),
                 "--drain-timeout", "60", *extra],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})})
        wait_for(lambda: self.sock.exists() or self.proc.poll() is not None, timeout=60,
                 what="the plugin's socket")
        assert self.proc.poll() is None, self.log()
        self.channel = grpc.insecure_channel(f"unix://{self.sock}")
        # the socket file appears at bind(), a moment before the server listens: a call then
        # is refused (UNAVAILABLE), so the plugin counts as started once the channel connects
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)

    def publish(self, volume_id: str, target: Path, attrs: dict[str, str], *,
                secrets: dict[str, str] | None = None, readonly: bool = False,
                cap: csi_pb2.VolumeCapability | None = None) -> None:
        req = csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, target_path=str(target), volume_context=attrs,
            secrets=secrets or {}, readonly=readonly,
            volume_capability=cap if cap is not None else mount_capability())
        self.node.NodePublishVolume(req, timeout=180)

    def unpublish(self, volume_id: str, target: Path | str) -> None:
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=volume_id, target_path=str(target)), timeout=180)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM, as kubelet stops the container; the exit status."""
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # every thread's stack into the log (faulthandler on SIGUSR1), then the test
                # fails with it: a stop that hangs is a bug to see, not to kill quietly
                self.proc.send_signal(signal.SIGUSR1)
                time.sleep(1)  # faulthandler writes at once; no event to wait on
                self.proc.kill()
                self.proc.wait()
                self.hung = self.log()
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        return self.proc.returncode


def _mounts_under(root: Path) -> list[Path]:
    with open("/proc/self/mountinfo") as f:
        mps = [Path(line.split()[4]) for line in f]
    return [mp for mp in mps if mp.is_relative_to(root)]


@pytest.fixture
def plugins(tmp_path):
    """Starts plugins; at the end stops them and leaves nothing mounted under tmp_path and no
    daemon of those mounts running, whatever the test did."""
    started: list[Plugin] = []

    def start(node_id: str, *extra: str, env: dict[str, str] | None = None) -> Plugin:
        require_fuse()
        p = Plugin(tmp_path, node_id, *extra, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()
    for mp in _mounts_under(tmp_path):
        reg = registration(mp)
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)
        if reg and pid_running(int(reg["pid"])):
            os.kill(int(reg["pid"]), signal.SIGKILL)
    assert not _mounts_under(tmp_path)


def pending_sets(mountpoint: Path) -> int:
    import ckptfs.api

    return ckptfs.api.status(mountpoint)["tiering"]["pending_sets"]


def umount_child(plugin: Plugin) -> bool:
    """The plugin is running `ckptfs umount` (its unpublish is draining)."""
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if int(stat.rpartition(")")[2].split()[1]) == plugin.proc.pid and b"umount" in cmd:
            return True
    return False


def rpc_error(call, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        call(*args, **kw)
    return ei.value.code(), ei.value.details()


# ----------------------------------------------------------------------------------------------
# a pod's processes: write a checkpoint, read it back

WRITER = """
import sys, torch
g = torch.Generator().manual_seed(1234)
state = {"w": torch.randn(512, 512, generator=g), "ids": torch.randint(0, 1 << 40, (4096,),
         generator=g), "step": 7}
for path in sys.argv[1:]:
    torch.save(state, path)
"""
READER = """
import sys, torch
g = torch.Generator().manual_seed(1234)
want = {"w": torch.randn(512, 512, generator=g), "ids": torch.randint(0, 1 << 40, (4096,),
        generator=g), "step": 7}
for path in sys.argv[1:]:
    got = torch.load(path)
    assert got["step"] == 7
    assert torch.equal(got["w"].view(torch.int32), want["w"].view(torch.int32))
    assert torch.equal(got["ids"], want["ids"])
print("bit-exact")
"""


def run_python(code: str, *args: str) -> str:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_publish_write_unpublish_then_another_node_loads_it(plugins, moto_server, tmp_path):
    # moto in every pass (also the RGW one): the volume's secrets are made-up, distinctive values
    # the test looks for in logs and argv, which a real server's users cannot have
    endpoint, bucket = moto_server, new_bucket(moto_server)
    # a volume id that would climb out of the cache root if joined as a path
    vol = "../../escape/ckpt-run-1"
    attrs = {"store": f"s3://{bucket}/run-1", "endpoint": endpoint, "region": "us-east-1",
             "path-style": "true", "compress": "auto", "cache-size": "1G",
             # one file uploading at a time: the second set waits behind the first, held one
             "upload-files": "1",
             # what kubelet adds with podInfoOnMount
             "csi.storage.k8s.io/pod.name": "train-0",
             "csi.storage.k8s.io/pod.namespace": "default",
             "csi.storage.k8s.io/ephemeral": "false"}
    secret = f"csi-secret-{uuid.uuid4().hex}"
    secrets = {"awsAccessKeyID": "AKIACSITESTKEY", "awsSecretAccessKey": secret}
    gate = tmp_path / "uploads-held"
    n1 = plugins("node-1", env=hold_uploads(gate))  # passed on to the daemons it starts

    assert n1.identity.Probe(csi_pb2.ProbeRequest()).ready.value is True
    info = n1.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert info.name == DRIVER_NAME and info.vendor_version
    assert n1.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).node_id == "node-1"
    caps = n1.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest()).capabilities
    stage = csi_pb2.NodeServiceCapability.RPC.STAGE_UNSTAGE_VOLUME
    assert stage not in [c.rpc.type for c in caps]

    # kubelet made the parent; the plugin makes the target itself
    target = tmp_path / "pods" / "uid-1" / "volumes" / "kubernetes.io~csi" / "pv" / "mount"
    target.parent.mkdir(parents=True)
    n1.publish(vol, target, attrs, secrets=secrets)
    assert is_mounted(target)
    n1.publish(vol, target, attrs, secrets=secrets)  # again: OK, the same mount
    reg = registration(target)
    assert reg is not None
    daemon = int(reg["pid"])

    # the cache dir is one directory inside the cache root, nothing outside it
    [cache_dir] = list(n1.cache_root.iterdir())
    assert Path(reg["cache_dir"]) == cache_dir and (cache_dir / "layout.json").exists()
    assert not (tmp_path / "escape").exists() and not (tmp_path / "node-1" / "escape").exists()

    # the secret reached the daemon through its environment, never its command line
    assert secret.encode() not in Path(f"/proc/{daemon}/cmdline").read_bytes()
    assert f"AWS_SECRET_ACCESS_KEY={secret}".encode() in Path(
        f"/proc/{daemon}/environ").read_bytes().split(b"\0")

    # another volume at this target; this volume at a second target of the node
    other = tmp_path / "pods" / "uid-2" / "mount"
    code, msg = rpc_error(n1.publish, "other-volume", target, attrs)
    assert code == Code.ALREADY_EXISTS, msg
    code, msg = rpc_error(n1.publish, vol, other, attrs)
    assert code == Code.FAILED_PRECONDITION and "one mount per volume per node" in msg, msg
    assert not is_mounted(other)

    # the pod's process writes a checkpoint (two files, two sets), exits; the uploads are held:
    # the sets are at risk, one upload in flight, the other queued behind it
    files = ("model.pt", "optim.pt")
    run_python(WRITER, *(str(target / f) for f in files))
    wait_for(lambda: pending_sets(target) == 2, what="the checkpoint's sets to be pending")
    # kubelet unpublishes; the unpublish waits for the upload, released only once it drains
    errors: list[BaseException] = []

    def unpublish_in_thread() -> None:
        try:
            n1.unpublish(vol, target)
        except BaseException as e:  # noqa: BLE001 (reported by the test's thread below)
            errors.append(e)

    unpublish = threading.Thread(target=unpublish_in_thread)
    unpublish.start()
    try:
        wait_for(lambda: umount_child(n1), what="the unpublish to drain")
        assert is_mounted(target) and pending_sets(target) == 2
    finally:
        gate.unlink()
    unpublish.join(timeout=120)
    assert not unpublish.is_alive() and not errors, errors
    assert not is_mounted(target) and not target.exists()
    wait_for(lambda: not pid_running(daemon), what="the daemon to exit")
    n1.unpublish(vol, target)  # again: OK, nothing there

    # a new node: another plugin, node id and cache root, the same volume
    n2 = plugins("node-2")
    target2 = tmp_path / "pods" / "uid-3" / "mount"
    n2.publish(vol, target2, attrs, secrets=secrets)
    assert "bit-exact" in run_python(READER, *(str(target2 / f) for f in files))
    n2.unpublish(vol, target2)
    assert not is_mounted(target2) and not target2.exists()

    for p in (n1, n2):
        assert p.stop() == 0, p.hung
        log = p.log()
        assert secret not in log and "AKIACSITESTKEY" not in log
        assert f"published volume {vol!r} at" in log and f"unpublished volume {vol!r}" in log
    for d in (cache_dir, *n2.cache_root.iterdir()):
        assert secret not in (d / "ckptfs.log").read_text()
    log1 = n1.log()
    assert log1.count(f"published volume {vol!r} at {target} (store") == 1
    assert log1.count(f"unpublished volume {vol!r} at {target} (drained and unmounted)") == 1


def test_invalid_requests_get_their_status_codes(plugins, tmp_path):
    p = plugins("node-1")
    target = tmp_path / "t"
    attrs = {"store": "s3://bucket/prefix"}
    cases = [
        (csi_pb2.NodePublishVolumeRequest(target_path=str(target), volume_context=attrs,
                                          volume_capability=mount_capability()), "volume_id"),
        (csi_pb2.NodePublishVolumeRequest(volume_id="v", volume_context=attrs,
                                          volume_capability=mount_capability()), "target_path"),
        (csi_pb2.NodePublishVolumeRequest(volume_id="v", target_path=str(target),
                                          volume_context=attrs), "volume_capability"),
        (csi_pb2.NodePublishVolumeRequest(volume_id="v", target_path="relative/t",
                                          volume_context=attrs,
                                          volume_capability=mount_capability()), "absolute"),
    ]
    for req, word in cases:
        code, msg = rpc_error(p.node.NodePublishVolume, req)
        assert code == Code.INVALID_ARGUMENT and word in msg, (word, msg)

    def refused(attrs: dict[str, str], **kw) -> str:
        code, msg = rpc_error(p.publish, "v", target, attrs, **kw)
        assert code == Code.INVALID_ARGUMENT, msg
        return msg

    assert "'cache_size'" in refused({**attrs, "cache_size": "1G"})  # a typo, named
    assert "'store'" in refused({"region": "us-east-1"})
    assert "file://" in refused({"store": "file:///var/lib/kubelet/pods"})
    assert "true or false" in refused({**attrs, "path-style": "yes"})
    assert "cache-size" in refused({**attrs, "cache-size": "lots"})  # ckptfs mount's own check
    msg = refused(attrs, secrets={"password": "hunter2-secret-value"})
    assert "'password'" in msg and "hunter2" not in msg
    block = csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume())
    assert "block" in refused(attrs, cap=block)
    assert "fs_type" in refused(attrs, cap=mount_capability("ext4"))
    flags = mount_capability()
    flags.mount.mount_flags.append("noatime")
    assert "mount flags" in refused(attrs, cap=flags)
    assert not target.exists() and not is_mounted(target)

    for req, word in [(csi_pb2.NodeUnpublishVolumeRequest(target_path=str(target)), "volume_id"),
                      (csi_pb2.NodeUnpublishVolumeRequest(volume_id="v"), "target_path")]:
        code, msg = rpc_error(p.node.NodeUnpublishVolume, req)
        assert code == Code.INVALID_ARGUMENT and word in msg, (word, msg)
    p.unpublish("v", tmp_path / "never-published")  # unknown target: OK
    target.mkdir()
    p.unpublish("v", target)  # an empty, unmounted target: OK, and removed as the spec asks
    assert not target.exists()
    assert "hunter2" not in p.log()
    assert p.stop() == 0, p.hung


def test_publish_of_a_file_store_mounts_only_when_allowed(plugins, tmp_path):
    """--allow-file-stores (tests, single machines): a file:// store mounts and unmounts; the
    mount is a real ckptfs mount of that store."""
    p = plugins("node-1", "--allow-file-stores")
    target = tmp_path / "t"
    attrs = {"store": f"file://{tmp_path / 'store'}", "no-passthrough": "true"}
    p.publish("vol", target, attrs)
    (target / "x").write_bytes(b"hello")
    assert (target / "x").read_bytes() == b"hello"
    p.unpublish("vol", target)
    assert not is_mounted(target) and not target.exists()
    assert list((tmp_path / "store").iterdir())  # the set went to the store
    assert p.stop() == 0, p.hung


def test_readonly_publish_is_a_read_only_mount(plugins, tmp_path):
    """A pod's readOnly volume (readonly=True): the kernel mount is ro, every change EROFS, what
    a read-write publish of the volume wrote is readable, and the store is left as it was."""
    p = plugins("node-1", "--allow-file-stores")
    store = tmp_path / "store"
    attrs = {"store": f"file://{store}", "no-passthrough": "true"}
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    p.publish("vol", rw, attrs)
    (rw / "ckpt.pt").write_bytes(b"weights" * 1000)
    p.unpublish("vol", rw)   # drained: the set is in the store
    before = sorted(str(f.relative_to(store)) for f in store.rglob("*"))
    p.publish("vol", ro, attrs, readonly=True)
    try:
        with open("/proc/self/mountinfo") as f:
            opts = next(line.split()[5] for line in f if line.split()[4] == str(ro))
        assert "ro" in opts.split(","), opts
        assert (ro / "ckpt.pt").read_bytes() == b"weights" * 1000
        with pytest.raises(OSError) as e:
            (ro / "new.pt").write_bytes(b"x")
        assert e.value.errno == errno.EROFS
        with pytest.raises(OSError) as e:
            (ro / "ckpt.pt").unlink()
        assert e.value.errno == errno.EROFS
    finally:
        p.unpublish("vol", ro)
    assert not is_mounted(ro) and not ro.exists()
    assert sorted(str(f.relative_to(store)) for f in store.rglob("*")) == before


@pytest.mark.parametrize("volume_id", [
    "..", ".", "../..", "../../etc", "/abs/path", "a/b", "a_b", ".hidden", "x" * 300,
    "ns/pv\n\x01", "ünïcode/ボリューム", "-rf", "",
])
def test_cache_dir_names_are_one_safe_component(volume_id, tmp_path):
    name = cache_dir_name(volume_id)
    assert "/" not in name and "\0" not in name and not name.startswith(".")
    assert len(name.encode()) <= 255
    assert (tmp_path / name).parent == tmp_path
    assert name == cache_dir_name(volume_id)


def test_cache_dir_names_differ_where_ids_do():
    ids = ["a/b", "a_b", "a:b", "..a_b", "x" * 300, "x" * 301]
    assert len({cache_dir_name(i) for i in ids}) == len(ids)


def test_every_attribute_is_a_mount_option():
    known = mount_parser()._option_string_actions
    for key, (opt, flag) in ATTRIBUTES.items():
        assert opt in known, (key, opt)
        assert (known[opt].nargs == 0) == flag, (key, opt)
    for banned in ("--cache-dir", "--log-file", "--foreground", "--metrics"):
        assert banned not in [o for o, _ in ATTRIBUTES.values()]


def test_cli_refuses_bad_options_in_one_line():
    for args in (["--endpoint", "tcp://127.0.0.1:1", "--node-id", "n"],
                 ["--endpoint", "unix:///" + "x" * 200, "--node-id", "n"],
                 ["--endpoint", "unix:///tmp/x.sock", "--node-id", ""],
                 ["--endpoint", "unix:///tmp/x.sock", "--node-id", "n", "--drain-timeout",
                  "nan"]):
        r = subprocess.run([sys.executable, "-m", "ckptfs", "csi", *args], capture_output=True,
                           text=True, timeout=60, cwd=REPO)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("ckptfs: ")


# ----------------------------------------------------------------------------------------------
# deploy/: the manifests and the image


def _docs(name: str) -> list[dict]:
    with open(DEPLOY / "kubernetes" / name) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def test_manifests_pass_the_kubernetes_schemas():
    for f in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in _docs(f.name):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # the validator is live: an unknown field fails it
    bad = _docs("csidriver.yaml")[0]
    bad["spec"]["attachRequird"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_manifests_agree_with_the_code():
    [driver] = _docs("csidriver.yaml")
    assert driver["kind"] == "CSIDriver" and driver["metadata"]["name"] == DRIVER_NAME
    spec = driver["spec"]
    assert spec["attachRequired"] is False and spec["podInfoOnMount"] is True
    assert sorted(spec["volumeLifecycleModes"]) == ["Ephemeral", "Persistent"]

    [ds] = _docs("daemonset.yaml")
    pod = ds["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    plugin, registrar = containers["ckptfs"], containers["node-driver-registrar"]
    mounts = {m["name"]: m for m in plugin["volumeMounts"]}
    args = dict(a.removeprefix("--").split("=", 1) for a in plugin["args"])
    plugin_dir = f"/var/lib/kubelet/plugins/{DRIVER_NAME}"
    assert volumes["plugin-dir"]["hostPath"]["path"] == plugin_dir
    # the plugin serves the socket the registrar hands to kubelet, under the same host dir
    sock = args["endpoint"].removeprefix("unix://")
    assert Path(sock).parent == Path(mounts["plugin-dir"]["mountPath"])
    rargs = dict(a.removeprefix("--").split("=", 1) for a in registrar["args"])
    assert rargs["csi-address"] == sock
    assert rargs["kubelet-registration-path"] == f"{plugin_dir}/{Path(sock).name}"
    reg_mounts = {m["name"]: m["mountPath"] for m in registrar["volumeMounts"]}
    assert reg_mounts["registration-dir"] == "/registration"
    assert volumes["registration-dir"]["hostPath"]["path"] == "/var/lib/kubelet/plugins_registry"
    # kubelet's target paths are host paths: the pods dir at the same path, Bidirectional
    assert mounts["pods-dir"]["mountPath"] == volumes["pods-dir"]["hostPath"]["path"] == \
        "/var/lib/kubelet/pods"
    assert mounts["pods-dir"]["mountPropagation"] == "Bidirectional"
    assert plugin["securityContext"]["privileged"] is True
    assert volumes["fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert mounts["fuse"]["mountPath"] == "/dev/fuse"
    assert args["cache-root"] == mounts["cache-root"]["mountPath"]
    assert "hostPath" in volumes["cache-root"]
    env = {e["name"]: e for e in plugin["env"]}
    assert args["node-id"] == "$(NODE_ID)"
    assert env["NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"

    by_kind = {d["kind"]: d for d in _docs("example.yaml")}
    pv = by_kind["PersistentVolume"]["spec"]["csi"]
    assert pv["driver"] == DRIVER_NAME
    assert set(pv["volumeAttributes"]) <= set(ATTRIBUTES) and "store" in pv["volumeAttributes"]
    secret = by_kind["Secret"]
    assert set(secret["stringData"]) <= set(SECRETS)
    assert pv["nodePublishSecretRef"]["name"] == secret["metadata"]["name"]
    claim = by_kind["PersistentVolumeClaim"]
    assert claim["spec"]["volumeName"] == by_kind["PersistentVolume"]["metadata"]["name"]
    pod_vols = by_kind["Pod"]["spec"]["volumes"]
    assert pod_vols[0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_dockerfile_installs_the_csi_extra_without_torch():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert lines[0].startswith("FROM ") and "bookworm" in lines[0]  # Debian
    assert any("fuse3" in ln and "apt-get install" in ln for ln in lines)
    assert any('".[csi]"' in ln for ln in lines)
    assert "torch" not in "\n".join(lines)
    assert lines[-1] == 'ENTRYPOINT ["/usr/bin/tini", "--", "ckptfs", "csi"]'
