"""The resume checkpoint relayed inside the cluster (`--relay`, plan/relay.py's `plan_copy_relay` decides): the node
that holds it packs its files (the manifest last) into one archive and serves it (relay.py's `serving_packed`); the
nodes that lack it fetch it from there, or past the fan-out from a node that fetched it (relay.py's RelayTree), each
checking its size and sha256, then unpacking it into the checkpoint dir with the manifest renamed into place last
(checkpoint_land.sh: a copy cut short never counts). The copy is then validated on the node against the manifest
(checkpoints.py), as a copy through here is. Nothing passes through this machine; a node that cannot fetch it
is left to the caller (copied through here), with why."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

from orchestrate.backends.docker_ssh.checkpoints import validate
from orchestrate.backends.docker_ssh.relay import RelayError, RelayTree, serving_packed
from orchestrate.errors import SSHError
from orchestrate.plan.relay import RelayPlan
from orchestrate.probe.observations import Checkpoint
from orchestrate.remote import scripts
from orchestrate.remote.session import Session

LAND_SCRIPT = scripts.text("checkpoint_land.sh")


def land_command(folder: str, manifest_name: str) -> list[str]:
    """The node's command that unpacks the checkpoint's archive (on its stdin) into `folder`, the manifest last."""
    return ["sh", "-c", LAND_SCRIPT, "land", folder, manifest_name]


def relay_checkpoint(nodes: Session, chosen: RelayPlan, ckpt: Checkpoint, folder_of: Callable[[int], str],
                     address_of: Callable[[int], str], say: Callable[[str], None]) -> dict[int, str]:
    """`ckpt` from the plan's relay node (which holds it) to the plan's other nodes, down its tree; one line per
    node. Returns, per node that does not hold a valid copy after it, why (the caller copies it through here)."""
    assert chosen.relay is not None
    what = f"checkpoint step {ckpt.step}"
    names = [*(name for name, _, _ in ckpt.files), ckpt.manifest_name]  # the manifest last, as it is landed

    def label(rank: int) -> str:
        return nodes.hosts[rank].label

    unfetched: dict[int, str] = {}
    with ExitStack() as stack:
        try:
            served = stack.enter_context(serving_packed(nodes.conn(chosen.relay), ckpt.folder, names, "checkpoint"))
        except RelayError as err:
            say(f"{what}: node {chosen.relay} ({label(chosen.relay)}) could not serve it ({err}); copying it to each "
                "node through here")
            return {rank: str(err) for rank in chosen.fetch}
        tree = RelayTree(chosen, served, nodes.conn, address_of, label, say, stack, what)

        def fetch(rank: int) -> None:
            via, why = tree.fetch(rank, land_command(folder_of(rank), ckpt.manifest_name))
            if why is None:
                why = _check(nodes, rank, ckpt, folder_of(rank))
            if why is None:
                say(f"{what} on {label(rank)}: fetched from the relay on {via}, sha256 verified, 0 bytes through here")
                return
            unfetched[rank] = why
            say(f"{what} on {label(rank)}: could not fetch from the relay on {via} ({why}); copying it through here")

        tree.walk(fetch, "checkpoint relay")
    return unfetched


def _check(nodes: Session, rank: int, ckpt: Checkpoint, folder: str) -> str | None:
    """None when the node's copy is valid and holds the very files chosen; else why not."""
    try:
        held = validate(nodes.conn(rank), folder, ckpt.manifest_name)
    except SSHError as err:
        return str(err)
    return None if held is not None and held.files == ckpt.files else "the copy does not match its manifest"
