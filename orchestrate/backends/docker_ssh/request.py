"""The Docker request a plan materializes into: each container's docker-py arguments (`sdk_kwargs`), the same as a
`docker run` line (`docker_run_argv`), and the dry run's text and JSON of the plan with them (secrets masked).
PURE: docker-py's types are plain data, imported where they are built."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from orchestrate.config import RELAY_FAN_OUT
from orchestrate.masking import mask_text, masked_env, secret_values, url_masked
from orchestrate.plan import gpus
from orchestrate.plan.jobplan import ContainerSpec, DataAction, ImageAction, JobPlan, NodePlan
from orchestrate.plan.relay import RelayPlan, plan_copy_relay, plan_relay


def docker_run_argv(spec: ContainerSpec) -> list[str]:
    """What --dry-run prints: the `docker run` command line rendered from sdk_kwargs(), the very arguments
    launch applies (each key has its flag; a key without one is a bug, not silently left out), with every
    secret's value masked wherever it appears."""
    kwargs = {**sdk_kwargs(spec), "environment": shown_env(spec.env)}
    argv = ["docker", "run"]
    for key, value in kwargs.items():
        if key not in ("image", "command", "entrypoint"):
            argv += _RUN_FLAGS[key](value)
    # `docker run --entrypoint` takes the program alone; its arguments go before the command's.
    entry = kwargs.get("entrypoint") or []
    argv += [f"--entrypoint={entry[0]}"] if entry else []
    argv += [kwargs["image"], *entry[1:], *kwargs["command"]]
    return [mask_text(a, secret_values(spec.env)) for a in argv]


def shown_env(env: dict[str, str]) -> dict[str, str]:
    """The environment as printed: secrets' values masked, and a password in a URL (the data fetch's DATA_URL)."""
    return {k: url_masked(v) for k, v in masked_env(env).items()}


def sdk_kwargs(spec: ContainerSpec) -> dict[str, Any]:
    """Keyword arguments for docker-py's containers.run / create."""
    import docker.types  # plain data; imported here so that materializing a plan loads docker-py only then

    requests = []
    if spec.gpus:
        requests.append(docker.types.DeviceRequest(**gpus.device_request(spec.gpus, spec.gpu_ids)))
    entry = {"entrypoint": list(spec.entrypoint)} if spec.entrypoint else {}  # else the image's own
    return dict(
        image=spec.image, command=list(spec.command), name=spec.name or None, detach=True, **entry,
        environment=dict(spec.env), labels=dict(spec.labels), network_mode=spec.network_mode,
        init=spec.init, ipc_mode=spec.ipc_mode, shm_size=spec.shm_size, device_requests=requests or None,
        # No swap beyond the limit: with swap the container could take twice as much, slowly.
        mem_limit=spec.memory, memswap_limit=spec.memory,
        ulimits=[docker.types.Ulimit(name=n, soft=s, hard=h) for n, s, h in spec.ulimits],
        mounts=[docker.types.Mount(m.target, m.source, type="bind", read_only=m.read_only)
                for m in spec.mounts],
        privileged=False, stop_signal="SIGTERM", user=spec.user, extra_hosts=[f"{name}:{addr}" for name, addr in spec.extra_hosts] or None,
        devices=list(spec.devices) or None, cap_add=list(spec.cap_add) or None,
    )


def _mount_flag(mount: Any) -> list[str]:
    # --mount, not --volume: a bind mount of a missing folder fails instead of creating it as root.
    ro = ",readonly" if mount.get("ReadOnly") else ""
    return [f"--mount=type={mount['Type']},source={mount['Source']},target={mount['Target']}{ro}"]


# docker-py's run() keyword → the `docker run` flags that mean the same (docs.docker.com, "docker run").
_RUN_FLAGS: dict[str, Callable[[Any], list[str]]] = {
    "name": lambda v: ["--name", v] if v else [],  # none: Docker makes one up (the short containers)
    "detach": lambda v: ["--detach"] if v else [],
    "network_mode": lambda v: [f"--network={v}"],
    "user": lambda v: [f"--user={v}"] if v else [],
    "init": lambda v: ["--init"] if v else [],
    "ipc_mode": lambda v: [f"--ipc={v}"] if v else [],
    "shm_size": lambda v: [f"--shm-size={v}"] if v else [],
    "mem_limit": lambda v: [f"--memory={v}"] if v else [],
    "memswap_limit": lambda v: [f"--memory-swap={v}"] if v else [],
    "device_requests": gpus.gpus_flag,
    "ulimits": lambda v: [f"--ulimit={u['Name']}={u['Soft']}:{u['Hard']}" for u in v],
    "extra_hosts": lambda v: [f"--add-host={entry}" for entry in v or ()],
    "labels": lambda v: [f"--label={k}={x}" for k, x in v.items()],
    "environment": lambda v: [f"--env={k}={x}" for k, x in v.items()],
    "mounts": lambda v: [flag for m in v for flag in _mount_flag(m)],
    "privileged": lambda v: ["--privileged"] if v else [],
    "stop_signal": lambda v: [f"--stop-signal={v}"],
    "devices": lambda v: [f"--device={d}" for d in v or ()],
    "cap_add": lambda v: [f"--cap-add={c}" for c in v or ()],
}


def render_plan(specs: Sequence[ContainerSpec]) -> str:
    """Human-readable plan, secrets masked: per node, the container and its full arguments."""
    lines: list[str] = []
    for spec in specs:
        lines.append(f"# node {spec.rank} on {spec.host.label} ({spec.host.source}): container {spec.name}")
        lines.append(shlex.join(docker_run_argv(spec)))
    return "\n".join(lines)


def render_job_plan(plan: JobPlan) -> str:
    """The plan as text, secrets masked: per node its folders, actions and `docker run` line."""
    a = plan.attempt
    lines = [f"# job {plan.job}: attempt {a.number}" + (f" ({a.cause})" if a.cause else "")
             + f", {len(plan.nodes)} node(s), master {plan.master}"]
    if plan.resume is not None:
        c = plan.resume.checkpoint
        lines.append(f"# resume: step {c.step} (epoch {c.epoch}) from node {plan.resume.source}:{c.path}"
                     + (f", copied to node(s) {', '.join(map(str, plan.resume.copy_to))} {_copied_text(plan)}"
                        if plan.resume.copy_to else ""))
    if plan.launcher is None:
        lines.append("# launcher: read from the image once node 0 pulled it (torchrun shown)")
    relay = relay_of(plan)
    if relay.relay is not None:
        lines.append(f"# image layers: sent once from here to node {relay.relay}, {_served_text(relay, 'them')} for the "
                     f"transfer's time (--relay {plan.relay_mode}); a node that cannot fetch them is sent them from here")
    data_relay = data_relay_of(plan)
    if data_relay.relay is not None:
        lines.append(f"# data (--data-from): what the nodes lack sent once from here to node {data_relay.relay}, "
                     f"{_served_text(data_relay, 'it')} for the transfer's time (--relay {plan.relay_mode}); a node that "
                     "cannot fetch it is sent it from here")
    for n in plan.nodes:
        lines.append(f"# node {n.rank} on {n.host.label}: container {n.container.name}")
        lines.append("#   dirs: " + ", ".join(f"{k} {v}" for k, v in n.dirs.items()))
        lines.append(f"#   GPUs: {n.gpus.why}")
        lines.append(f"#   image: {_image_text(n.image)}" + (f", from {relay.source(n.rank)}"
                                                             if n.image.kind == "send" else ""))
        lines.append(f"#   data: {_data_text(n.data)}" + (f", from {data_relay.source(n.rank)}"
                                                           if n.data.kind in RELAYED_DATA else ""))
        if plan.resume is not None and n.rank in plan.resume.copy_to:
            lines.append(f"#   resume checkpoint: copied from {_checkpoint_source(plan, n.rank)}")
        lines.append("#   leftovers removed: " + (", ".join(n.leftovers) or "none"))
        lines.append("#   checks: " + ", ".join(f"{v.check} {'ok' if v.ok else 'FAILED'} ({v.text})"
                                                for v in n.verdicts))
        short = [key.replace("_", " ") for key, spec in _short(n) if spec is not None]
        lines.append("#   short containers first: " + (", ".join(short) or "none") + " (--json: their arguments)")
        lines.append(shlex.join(docker_run_argv(n.container)))
    return "\n".join(lines)


def _copied_text(plan: JobPlan) -> str:
    """How the resume checkpoint reaches the nodes that lack it: served by the node that holds it, or through here."""
    relay = resume_relay_of(plan)
    if relay.relay is None:
        return "through here (from its node to this machine to theirs)"
    return (f"inside the cluster (--relay {plan.relay_mode}): node {relay.relay} "
            f"{_served_text(relay, 'it').removeprefix('which ')}; a node that cannot fetch it gets it through here")


def _served_text(relay: RelayPlan, them: str) -> str:
    """Who the relay node serves; past the fan-out, that the nodes which fetched serve the next (each node's line)."""
    assert relay.relay is not None
    first = relay.children(relay.relay)
    text = f"which serves {them} to node(s) {', '.join(map(str, first))}"
    if len(first) == len(relay.fetch):
        return text
    return (f"{text}; each node that fetched serves up to {RELAY_FAN_OUT} more (a relay tree: each node's line says "
            "from which node)")


def relay_of(plan: JobPlan) -> RelayPlan:
    """Who gets the layers from where, as planned (the nodes' bases pulled as planned)."""
    return plan_relay(plan.relay_mode, {n.rank: n.image.sent_from for n in plan.nodes if n.image.kind == "send"})


def resume_relay_of(plan: JobPlan) -> RelayPlan:
    """Who gets the resume checkpoint from where: the node that holds it serves it to those that lack it (--relay),
    or each copy goes through here."""
    if plan.resume is None:
        return RelayPlan(None)
    return plan_copy_relay(plan.relay_mode, plan.resume.source, plan.resume.copy_to)


RELAYED_DATA = ("sync", "send")  # the data kinds that --data-from sends from here: a folder synced, an archive


def data_relay_of(plan: JobPlan) -> RelayPlan:
    """Who gets the --data-from files or archive from where: the nodes that sync the folder (each is sent what it
    lacks, known only when the nodes are read, so the plan counts every syncing node) or lack a verified copy of
    the archive's data. A node on shared storage with another gets nothing, said then."""
    return plan_relay(plan.relay_mode, {n.rank: 0 for n in plan.nodes if n.data.kind in RELAYED_DATA})


def _checkpoint_source(plan: JobPlan, rank: int) -> str:
    """Where node `rank` gets the resume checkpoint from: 'node R', or 'node S through here'."""
    assert plan.resume is not None
    up = resume_relay_of(plan).parent(rank)
    return f"node {plan.resume.source} through here" if up is None else f"node {up}"


def _image_text(action: ImageAction) -> str:
    if action.kind != "send":
        return {"present": "present, nothing sent", "pull": "pulled"}[action.kind]
    size = f", {action.bytes / 1e6:.1f} MB uncompressed" if action.bytes is not None else ""
    sent = f"send {action.layers_sent} of {action.layers} layers{size}"
    if action.pull_base:
        return f"pull base {action.pull_base} on the node (its {action.base_layers} layers), then {sent}"
    return sent + (f" (base not pulled by the node: {action.base_why})" if action.base_why else "")


def _data_text(action: DataAction) -> str:
    return {"present": "verified copy present, nothing moved", "download": f"downloaded on the node from {action.source}",
            "send": f"archive {action.source} sent ({action.bytes} bytes)", "sync": f"{action.source} synced",
            "none": "nothing (the program finds its data)"}[action.kind]


def plan_json(plan: JobPlan) -> dict[str, Any]:
    """The plan as JSON-ready data (docs/orchestrate.md, "The plan as JSON"), secrets masked."""
    resume = None
    if plan.resume is not None:
        c = plan.resume.checkpoint
        resume = {"step": c.step, "epoch": c.epoch, "node": plan.resume.source, "path": c.path,
                  "copy_to": list(plan.resume.copy_to),
                  "copy_from": [_checkpoint_source(plan, rank) for rank in plan.resume.copy_to]}
    check = plan.image_check
    return {"form": "hosts", "job": plan.job, "master": plan.master,
            "attempt": dataclasses.asdict(plan.attempt), "launcher": list(plan.head) if plan.launcher else None,
            "resume": resume, "nodes": [_node_json(plan, n) for n in plan.nodes],
            "image_check": {"runs_on": plan.image_check_on or None, **container_json(check)} if check else None}


def _node_json(plan: JobPlan, node: NodePlan) -> dict[str, Any]:
    image = {**dataclasses.asdict(node.image), "layers_sent": node.image.layers_sent,
             "from": relay_of(plan).source(node.rank) if node.image.kind == "send" else None}
    return {"rank": node.rank, "host": node.host.label, "dirs": dict(node.dirs),
            "gpus": {"ids": list(node.gpus.ids), "why": node.gpus.why},
            "checks": [dataclasses.asdict(v) for v in node.verdicts], "image": image,
            "data": {**dataclasses.asdict(node.data),
                     "from": data_relay_of(plan).source(node.rank) if node.data.kind in RELAYED_DATA else None}, "leftovers": list(node.leftovers),
            **container_json(node.container),
            **{key: container_json(short) if short else None for key, short in _short(node)}}


def _short(node: NodePlan) -> list[tuple[str, ContainerSpec | None]]:
    """The node's short containers, in the order they run, by their key in the JSON."""
    return [("gpu_probe", node.gpu_probe), ("fetch", node.fetch), ("network_check", node.network_check)]


def container_json(spec: ContainerSpec) -> dict[str, Any]:
    """The container's Docker SDK arguments (environment masked) and the same as a `docker run` line."""
    secrets = secret_values(spec.env)
    kwargs = {**sdk_kwargs(spec), "environment": shown_env(spec.env),
              "command": [mask_text(a, secrets) for a in spec.command]}
    return {"container": {k: v for k, v in kwargs.items() if k != "detach"}, "docker_run": docker_run_argv(spec)}


def offline_json(specs: Sequence[ContainerSpec]) -> dict[str, Any]:
    """The offline `--dry-run` as JSON: the containers only (nothing was probed)."""
    return {"form": "offline", "nodes": [{"rank": s.rank, "host": s.host.label, **container_json(s)}
                                         for s in specs]}
