"""The image and the data carried onto every node as the plan says (Scheduler.send_image, Scheduler.send_data): the
pipeline says when, these say how, over each node's SSH session and Docker daemon."""

from __future__ import annotations

from rich.console import Console

from orchestrate.backends.docker_ssh import carried
from orchestrate.backends.docker_ssh.data import make_dirs, prefetch_all
from orchestrate.backends.docker_ssh.datasync import stage_all
from orchestrate.backends.docker_ssh.image import ensure_images
from orchestrate.backends.docker_ssh.relay import relay_address
from orchestrate.config import Data, Delivery
from orchestrate.fanout import fan_out
from orchestrate.plan.jobplan import JobPlan
from orchestrate.probe.daemons import Local
from orchestrate.remote.session import Session


def send_image(nodes: Session, plan: JobPlan, local: Local, local_id: str | None, delivery: Delivery,
               console: Console) -> None:
    """The image onto every node as planned: nothing, a pull, or the layers it lacks (from what `submit` carried
    when --image-from names the image here)."""
    ensure_images(nodes, plan, local, local_id, console, delivery.layer_cache,
                  carried.source(delivery.image_from, local_id))


def send_data(nodes: Session, plan: JobPlan, data: Data, console: Console) -> None:
    """Every node's data as planned: CIFAR-10 (downloaded, or its archive sent, where no verified copy is), a
    folder or file of --data-from synced, or only the folders made for another program."""
    conns, dirs = nodes.connected(), [n.dirs for n in plan.nodes]
    kind = plan.nodes[0].data.kind  # one kind for all nodes but "present" (a verified copy already there)
    if kind == "sync":
        for line in stage_all(conns, dirs, data, console, plan.relay_mode,
                              lambda rank: relay_address(nodes, rank, plan.master)):
            console.print(line, markup=False, highlight=False)
        return
    if kind == "none":
        fan_out("dirs", list(range(len(conns))), lambda r: make_dirs(conns[r], dirs[r]), lambda r: conns[r].host.label)
        return
    fetches = [n.fetch for n in plan.nodes]  # none where a verified copy is present
    for res in prefetch_all(nodes, dirs, fetches, data, console, plan.relay_mode, plan.master):
        what = {"present": "verified copy present, nothing moved", "downloaded": f"downloaded {res.bytes_moved} bytes",
                "sent": f"sent {res.bytes_moved} bytes",
                "relayed": f"archive fetched from the relay on {res.shared_with}, 0 bytes sent from here",
                "shared": f"same folder as on {res.shared_with} (shared storage), nothing moved"}[res.action]
        console.print(f"data on {res.label}: {what}", markup=False, highlight=False)
