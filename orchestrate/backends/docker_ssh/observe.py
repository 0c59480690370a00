"""The probe's reads of the Docker daemons, here and on each node, answered in the probe's plain types (the Daemons
protocol, probe/daemons.py): the local image, its layers, base and platform; each node's daemon version, the
containers' claims and the caller's own containers, the image ID, the platform, the layers held, a registry
reached; and the image check's short container. Read-only but for that one container, which is removed."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from orchestrate.backends.docker_ssh.request import sdk_kwargs
from orchestrate.errors import PreflightError
from orchestrate.fanout import fan_out
from orchestrate.labels import GPUS_LABEL, JOB_LABEL, PORT_LABEL, is_mine
from orchestrate.plan.jobplan import ContainerSpec
from orchestrate.probe.baseimage import BASE_DIGEST_LABEL, BASE_NAME_LABEL, base_of
from orchestrate.probe.holdings import holdings
from orchestrate.probe.layers import all_chain_ids
from orchestrate.probe.observations import HOLDING, ContainerSeen, Held, Holdings, LocalBase, LocalImage, held
from orchestrate.remote.docker import client_over_ssh, job_containers
from orchestrate.remote.session import Session

if TYPE_CHECKING:  # docker-py is imported where it is used
    from docker import DockerClient

T = TypeVar("T")

# ---- this machine's daemon -------------------------------------------------------------------------------

def local_image(name: str) -> tuple[DockerClient | None, str | None]:
    """The local daemon's client and image ID (None, None when there is no local daemon)."""
    import docker
    import docker.errors

    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except Exception:
        return None, None
    try:
        return client, str(client.images.get(name).id)
    except docker.errors.ImageNotFound:
        return client, None


def local_layers(client: DockerClient | None, image_id: str | None) -> LocalImage | None:
    """The local image's layers and their sizes. The daemon's history lists one entry per build step, newest
    first, and says nothing of which made a layer: a step of size 0 is taken for one without (ENV, CMD), except a
    WORKDIR (it makes a folder: an empty layer). When the steps taken do not match the layers one for one, the
    sizes are not known."""
    if client is None or image_id is None:
        return None
    image = client.images.get(image_id)
    diff_ids = tuple(image.attrs["RootFS"]["Layers"])
    sizes = tuple(int(h["Size"]) for h in reversed(client.api.history(image_id))
                  if h.get("Size") or "WORKDIR" in (h.get("CreatedBy") or ""))
    return LocalImage(image_id, diff_ids, sizes if len(sizes) == len(diff_ids) else None,
                      local_base(client, image.labels, diff_ids))


def local_base(client: Any, labels: dict[str, str], diff_ids: Sequence[str]) -> LocalBase | None:
    """The base the local image records (None: it records none) and what the nodes may pull of it
    (probe/baseimage.py)."""
    import docker.errors

    name = labels.get(BASE_NAME_LABEL) or ""
    if not name:
        return None
    try:
        attrs = client.images.get(name).attrs
    except docker.errors.ImageNotFound:
        return base_of(name, "", diff_ids, None)
    return base_of(name, labels.get(BASE_DIGEST_LABEL) or "", diff_ids,
                   (attrs["RootFS"]["Layers"], attrs.get("RepoDigests") or []))


def local_platform(local_client: Any, image: str) -> tuple[str, str] | None:
    """(os, architecture) of the local image; None when there is no local image (then nothing is sent)."""
    if local_client is None:
        return None
    import docker.errors

    try:
        attrs = local_client.images.get(image).attrs
    except docker.errors.ImageNotFound:
        return None
    return str(attrs.get("Os") or "linux"), str(attrs.get("Architecture") or "")


# ---- each node's daemon ----------------------------------------------------------------------------------

def read_holdings(client: Any, job: str, uid: int, skip: Collection[str] = ()) -> Holdings:
    """The claims on this daemon (probe/holdings.py); `skip`: container IDs that are the caller's own claim being
    checked."""
    return holdings(_claiming(client, job, uid, skip), job, uid, skip)


def created_claim(container: Any) -> Held | None:
    """The claim of a container this `up` just created: docker-py's create reads the container back, so its
    creation time is already the daemon's (a reload here was a second read of it, one request per node between the
    creates and the starts)."""
    return held(container.id, container.labels, container.status, container.attrs.get("Created", ""))


def _claiming(client: Any, job: str, uid: int, skip: Collection[str]) -> list[ContainerSeen]:
    """The labelled containers that can count in the holdings. Listed sparse: docker-py's full listing reads every
    listed container again, and each job a node ran leaves an exited container with a port label, so every `up`
    read them all, three times per node. Only another job's container in a holding state is read whole (its
    creation time to the nanosecond orders the claims); the caller's own count by their labels alone, and the
    rest hold nothing (probe/observations.py's `held`)."""
    import docker.errors

    listed = {c.id: c.attrs for label in (GPUS_LABEL, PORT_LABEL)
              for c in client.containers.list(all=True, filters={"label": label}, sparse=True)}
    found = []
    for cid, summary in listed.items():
        labels, state = summary.get("Labels") or {}, str(summary.get("State", ""))
        if cid in skip:
            continue
        if labels.get(JOB_LABEL) == job and is_mine(labels, uid):
            found.append(ContainerSeen(cid, state, labels))
        elif state in HOLDING:
            try:
                c = client.containers.get(cid)
            except docker.errors.NotFound:
                # Another `up` that lost its claim removes its containers at that very moment (a 404 failed the
                # claim check in CI): a container gone holds nothing.
                continue
            found.append(ContainerSeen(c.id, c.status, c.labels, c.attrs.get("Created", "")))
    return found


def my_containers(client: Any, job: str, uid: int) -> list[ContainerSeen]:
    """The caller's containers of the job on the host (the login `uid`'s, labels/ownership in labels.py)."""
    return [ContainerSeen(c.id, c.status, c.labels, c.attrs.get("Created", ""), c.name)
            for c in job_containers(client, job) if is_mine(c.labels, uid)]


def node_platform(client: Any) -> tuple[str, str]:
    """(os, uname -m machine) of the node's daemon."""
    info = client.info()
    return str(info.get("OSType") or "linux"), str(info.get("Architecture"))


def node_chain_ids(client: Any) -> set[str]:
    """Chain IDs of every layer the node's daemon holds (its images' RootFS layers), over the node's tunnel."""
    layer_lists = []
    for summary in client.api.images(all=True):
        rootfs = client.api.inspect_image(summary["Id"]).get("RootFS") or {}
        layer_lists.append(rootfs.get("Layers") or [])
    return all_chain_ids(layer_lists)


def registry_reach(client: Any, ref: str) -> str:
    """"" when the node's daemon gets the base's manifest descriptor from its registry; else why not. `client`'s
    read timeout bounds the wait (dockerd's own dial timeout is 30 s per address)."""
    import docker.errors
    import requests.exceptions

    try:
        client.images.get_registry_data(ref)
    except docker.errors.APIError as err:
        return f"its registry does not answer the node's daemon ({err.explanation or err})"
    except requests.exceptions.RequestException as err:
        return f"the node's daemon did not say whether it reaches its registry ({type(err).__name__})"
    return ""


def each_node(nodes: Session, what: str, ranks: Sequence[int], read: Callable[[Any], T]) -> list[T]:
    """`read(client)` of every node of `ranks`, in parallel, in `ranks` order (MultiHostError: one line per host)."""
    return fan_out(what, list(ranks), lambda r: read(nodes.docker(r)), lambda r: nodes.hosts[r].label)


# ---- the image check -------------------------------------------------------------------------------------

def image_check(nodes: Session, spec: ContainerSpec, here: Any) -> str:
    """The output of the image check container `spec` (plan/shortlived.py), run to its end and removed: on node 0
    with a client of its own, closed at once (its channels must not add to the job's on a host with OpenSSH's
    stock MaxSessions, 10 channels per connection); or on `here`, the local daemon's client, for an image that
    node 0 gets from here (the same ID: the same files), so that the plan knows the launcher before anything is
    sent."""
    client = here if here is not None else client_over_ssh(nodes.conn(0), timeout=120)
    try:
        return run_check(client, spec.image, sdk_kwargs(spec))
    finally:
        if here is None:
            client.close()


def run_check(client: Any, image: str, request: dict[str, Any]) -> str:
    """The check container of docker-py arguments `request` run to its end on `client`; its output."""
    import docker.errors

    try:
        out = client.containers.run(**{**request, "detach": False}, remove=True, stdout=True, stderr=True)
    except docker.errors.ContainerError as err:
        stderr = err.stderr.decode(errors="replace").strip() if isinstance(err.stderr, bytes) else ""
        raise PreflightError(f"preflight failed, nothing was started: image {image}: the check "
                             f"container failed ({stderr[-200:] or err.exit_status}); does it have sh?") from None
    except docker.errors.APIError as err:
        raise PreflightError(f"preflight failed, nothing was started: image {image} cannot run "
                             f"({err.explanation or err}); does it have sh?") from None
    return str(out.decode(errors="replace"))
