"""Layer-aware image transfer, the pure parts: chain IDs, held prefixes, which save entry is which layer, and
the filter that leaves a node's held layers out of one `docker save` stream."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

from orchestrate.backends.docker_ssh.savetar import Feed, Sink, filter_save, oci_layer_index, v1_layer_index
from orchestrate.backends.docker_ssh.sendlayers import summary_line
from orchestrate.probe.layers import all_chain_ids, chain_ids, held_prefix

DATA = Path(__file__).parent / "data"
# RootFS diff IDs of ddp-cifar:cpu as built on this machine (Docker 20.10.24); the two json files are the
# first and last layer folders' `json` from its `docker save`, whose folder names (v1 IDs) are below.
DIFF_IDS = ["sha256:2b732b73477ccabf5bf4c15f9fdf50e90fd622666ba7987e47047d46f3efe59f",
            "sha256:74fa01c1de014ea722e7979b5581f65a65a042d8d0040ea505c443340128d245",
            "sha256:2896d1c2addc4098710b2274b1fe9fadd42dc23e88fa8c7ad26cd546935fad32",
            "sha256:cf6ae639df281040b4badca3906c86cca07c5c7e25e38fa8efb7e6479cf593bd",
            "sha256:5e4ac4ce2d1ff24d7e95a519dc2b16765d5a0520fac78e36c66b1bd35bd21280"]
FOLDER0 = "44194326be7b2f38bab051c52c36a87dc9254d745d27993023a107c8841127fa"
FOLDER4 = "d3dd61b2099101abd5e29757e373ffa3602929350e10c5a39f0c59bece48edea"


def test_chain_ids_follow_the_oci_rule() -> None:
    chains = chain_ids(DIFF_IDS[:2])
    assert chains[0] == DIFF_IDS[0]
    assert chains[1] == "sha256:" + hashlib.sha256(f"{DIFF_IDS[0]} {DIFF_IDS[1]}".encode()).hexdigest()
    # the same diff ID on another parent is another layer
    assert chain_ids([DIFF_IDS[1]])[0] != chains[1]


def test_held_prefix_stops_at_the_first_missing_chain() -> None:
    old = DIFF_IDS[:4] + ["sha256:" + "0" * 64]  # the previous build: same base, other trainer layer
    held = all_chain_ids([old, DIFF_IDS[:1]])
    assert held_prefix(DIFF_IDS, held) == 4
    assert held_prefix(DIFF_IDS, set()) == 0
    assert held_prefix(DIFF_IDS, all_chain_ids([DIFF_IDS])) == 5
    # a node that holds layer 2's diff ID on another parent holds nothing of this image past layer 0
    assert held_prefix(DIFF_IDS, all_chain_ids([DIFF_IDS[:1], DIFF_IDS[2:3]])) == 1


def test_v1_folder_names_identify_layers_as_docker_20_10_writes_them() -> None:
    chains = chain_ids(DIFF_IDS)
    assert v1_layer_index(FOLDER0, (DATA / "save-layer0.json").read_bytes(), chains) == 0
    assert v1_layer_index(FOLDER4, (DATA / "save-layer4.json").read_bytes(), chains) == 4
    assert v1_layer_index(FOLDER4, (DATA / "save-layer0.json").read_bytes(), chains) is None
    assert v1_layer_index(FOLDER0, b"not json", chains) is None


def test_oci_layout_names_layers_by_diff_id() -> None:
    assert oci_layer_index("blobs/sha256/" + DIFF_IDS[3][7:], DIFF_IDS) == 3
    assert oci_layer_index("blobs/sha256/" + "1" * 64, DIFF_IDS) is None
    assert oci_layer_index("manifest.json", DIFF_IDS) is None


# ---- the filter, on a synthetic archive in Docker 20.10's layout ----------------------------------------


def _v1_id(meta: dict, chain: str) -> str:
    body = {k: v for k, v in meta.items() if k != "id"}
    if body.get("parent"):
        body["parent"] = "sha256:" + body["parent"]
    return hashlib.sha256(json.dumps(dict(sorted({**body, "layer_id": chain}.items())),
                                     separators=(",", ":")).encode()).hexdigest()


def _save_archive(layers: list[bytes]) -> tuple[bytes, list[str]]:
    diff_ids = ["sha256:" + hashlib.sha256(tar).hexdigest() for tar in layers]
    chains = chain_ids(diff_ids)
    entries: dict[str, bytes] = {"cfg.json": b'{"rootfs":{}}'}
    folders, parent = [], ""
    for chain in chains:
        meta = {"created": "1970-01-01T00:00:00Z", **({"parent": parent} if parent else {})}
        folder = _v1_id(meta, chain)
        entries[f"{folder}/VERSION"] = b"1.0"
        entries[f"{folder}/json"] = json.dumps({"id": folder, **meta}).encode()
        folders.append(folder)
        parent = folder
    for folder, tar in zip(folders, layers, strict=True):
        entries[f"{folder}/layer.tar"] = tar
    entries["manifest.json"] = json.dumps([{"Config": "cfg.json", "Layers": [f"{f}/layer.tar" for f in folders]}]
                                          ).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name in sorted(entries):  # Docker writes the folder in name order
            info = tarfile.TarInfo(name)
            info.size = len(entries[name])
            tar.addfile(info, io.BytesIO(entries[name]))
    return out.getvalue(), diff_ids


def _drain(sink: Sink) -> bytes:
    feed = sink.feeds[0]
    chunks = []
    while (chunk := feed.chunks.get_nowait()) is not None:
        chunks.append(chunk)
    return gzip.decompress(b"".join(chunks))


def test_filter_leaves_out_held_layers_and_keeps_everything_else() -> None:
    layers = [b"base" * 20000, b"deps" * 5000, b"trainer-v2"]
    archive, diff_ids = _save_archive(layers)
    sinks = [Sink(p, [Feed()]) for p in (0, 2)]
    for feed in (s.feeds[0] for s in sinks):
        feed.chunks.maxsize = 0  # unbounded: this test reads after the producer is done
    stream = iter([archive[i:i + 7000] for i in range(0, len(archive), 7000)])
    total = filter_save(stream, diff_ids, sinks)
    for sink in sinks:
        sink.finish()
    assert total == len(archive)
    full, delta = (_drain(s) for s in sinks)
    with tarfile.open(fileobj=io.BytesIO(full)) as tar:
        original = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert original == {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(delta)) as tar:
        kept = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    dropped = set(original) - set(kept)
    assert len(dropped) == 2 and all(original[n] in layers[:2] for n in dropped)
    assert b"trainer-v2" in kept.values() and "manifest.json" in kept and "cfg.json" in kept
    assert (sinks[0].layers_sent, sinks[1].layers_sent) == (3, 1)
    assert sinks[1].sent < 1000 < sinks[0].sent


def test_summary_line_names_the_delta() -> None:
    assert summary_line("img:cpu", "h1", 31_000, 1, 5, 912_000_000) == \
        "image img:cpu on h1: sent 0.03 MB (1 of 5 layers) of 912 MB"


# ---- fallback: a delta that does not load is replaced by the full archive (fakes for the daemons) --------


class _Api:
    def __init__(self, held: list[str], fail_delta: bool) -> None:
        self.held, self.fail_delta, self.loaded_id, self.archives = held, fail_delta, "", []  # type: ignore[var-annotated]
        self.pulled: list[str] = []
        self.pull_error = ""

    def images(self, all: bool = False) -> list[dict[str, str]]:
        return [{"Id": "old"}]

    def inspect_image(self, ref: str) -> dict[str, object]:
        return {"RootFS": {"Layers": self.held}}

    def load_image(self, chunks):  # type: ignore[no-untyped-def]
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(b"".join(chunks)))) as tar:
            names = [m.name for m in tar]
        self.archives.append(names)
        if self.fail_delta and len([n for n in names if n.endswith("layer.tar")]) < 3:
            yield {"error": "open /var/lib/docker/tmp/x/layer.tar: no such file or directory"}
            return
        self.loaded_id = "sha256:new"
        yield {"stream": "Loaded image: img:new"}


class _Client:
    def __init__(self, api: _Api) -> None:
        self.api = api
        self.images = self

    def pull(self, ref: str) -> None:
        if self.api.pull_error:
            import docker.errors
            raise docker.errors.APIError(self.api.pull_error)
        self.api.pulled.append(ref)

    def get(self, name: str):  # type: ignore[no-untyped-def]
        if not self.api.loaded_id:
            import docker.errors
            raise docker.errors.ImageNotFound(name)
        return type("Img", (), {"id": self.api.loaded_id})()


class _Nodes:
    def __init__(self, apis: list[_Api]) -> None:
        self.hosts = [type("H", (), {"label": f"h{i}"})() for i in range(len(apis))]
        self.clients = [_Client(a) for a in apis]

    def docker(self, rank: int, timeout: float | None = 60.0) -> _Client:
        return self.clients[rank]


class _Local:
    def __init__(self, archive: bytes, diff_ids: list[str]) -> None:
        self.archive, self.attrs, self.images = archive, {"RootFS": {"Layers": diff_ids}}, self
        self.tags = ["img:new"]

    def get(self, name: str) -> _Local:
        return self

    def save(self, named: bool, chunk_size: int):  # type: ignore[no-untyped-def]
        return iter([self.archive[i:i + chunk_size] for i in range(0, len(self.archive), chunk_size)])


def test_a_delta_that_fails_to_load_falls_back_to_the_full_archive() -> None:
    from rich.console import Console

    from orchestrate.backends.docker_ssh.image import deliver

    archive, diff_ids = _save_archive([b"base" * 20000, b"deps" * 5000, b"trainer-v2"])
    old = diff_ids[:2] + ["sha256:" + "0" * 64]
    apis = [_Api(old, fail_delta=True), _Api(old, fail_delta=False)]
    console = Console(record=True, width=200)
    done = deliver(_Nodes(apis), {0: 2, 1: 2}, _Local(archive, diff_ids), "sha256:new", "img:new", console)  # type: ignore[arg-type]
    out = console.export_text()
    assert "image img:new on h0: layer delta failed (docker load: open /var/lib/docker/tmp/x/layer.tar" in out
    assert "sending the full image" in out and "h1: layer delta failed" not in out
    # h0 got the delta, then the full archive; h1 (same layers held) only the shared delta
    assert [sum(n.endswith("layer.tar") for n in names) for names in apis[0].archives] == [1, 3]
    assert [sum(n.endswith("layer.tar") for n in names) for names in apis[1].archives] == [1]
    assert (done[0].layers_sent, done[1].layers_sent) == (3, 1)
    assert done[0].sent > done[1].sent and not done[0].fallback


def test_a_node_whose_base_pull_fails_gets_the_base_layers_sent_with_one_line_why() -> None:
    from types import SimpleNamespace

    from rich.console import Console

    from orchestrate.backends.docker_ssh.basepull import base_first
    from orchestrate.plan.jobplan import ImageAction

    pull = ImageAction("send", 5, 1, None, pull_base="reg/b@sha256:x", base_layers=3)
    cut_off = ImageAction("send", 5, 0, None, base_why="no route to host")
    plan = SimpleNamespace(nodes=[SimpleNamespace(rank=r, image=a) for r, a in enumerate((pull, pull, cut_off, pull))])
    apis = [_Api([], False) for _ in range(4)]
    apis[1].pull_error = "no space left on device"
    console = Console(record=True, width=80)
    assert base_first(_Nodes(apis), plan, "img:new", console) == {0: 3, 1: 1, 2: 0, 3: 3}  # type: ignore[arg-type]
    assert [a.pulled for a in apis] == [["reg/b@sha256:x"], [], [], ["reg/b@sha256:x"]]
    assert console.export_text().splitlines() == [
        "image img:new on h2: base not pulled by the node: no route to host; sending its layers",
        "image img:new on h0, h3: pulled base reg/b@sha256:x from its registry",
        "image img:new on h1: pulling base reg/b@sha256:x failed (no space left on device); sending its layers"]


def test_timings_name_each_phase_in_order_even_when_one_fails() -> None:
    from orchestrate.timings import Timings

    timings = Timings()
    with timings.phase("connect"):
        pass
    try:
        with timings.phase("image"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert re.fullmatch(r"timings \(s\): connect 0\.\d\d, image 0\.\d\d; total 0\.\d\d", timings.render())
